"""Sums over the ranks (`parallax.engine.tables.reduction`): the scheme chosen by the payload's
size, and over one rank no collective at all (the tensor is its own sum)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from parallax.engine import process_group
from parallax.engine.tables import reduction


def test_the_sum_over_one_rank_is_the_tensor_itself_without_a_collective(
        group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("a collective over one rank")

    for name in ("all_reduce", "reduce", "broadcast", "all_to_all_single"):
        monkeypatch.setattr(dist, name, refused)
    monkeypatch.setattr(process_group, "all_to_all_single", refused)
    values = torch.tensor([1.5, -2.0, 3.25], dtype=torch.float64)
    for all_to_all in (None, True, False):
        reduction.all_reduce(values, group=group, all_to_all=all_to_all)
        assert values.tolist() == [1.5, -2.0, 3.25]


@pytest.mark.parametrize(("payload", "world", "small"), [
    (1024, 1, False), (1024, 4, True), (64 * 1024, 4, True), (64 * 1024 + 1, 4, False)])
def test_small_sums_go_by_one_all_to_all_up_to_the_bytes_sent(payload: int, world: int,
                                                              small: bool) -> None:
    assert reduction.small(payload, world) is small
