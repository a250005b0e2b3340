"""Tables held as column slices (`parallax.engine.tables.columns`, `Config.pooled_by_columns`):
how many slices, the slice rows' view and recipe, and a checkpoint's rows re-cut into another
count of slices (`parallax.checkpoint.sharded._in_rows_of`)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from parallax.checkpoint.sharded import _in_rows_of
from parallax.engine.tables.columns import column_slices, slices_of_rows, slices_view
from parallax.engine.tables.partitioning import RowPartitioning


@pytest.mark.parametrize(("width", "servers", "slices"), [
    (6, 1, 1), (6, 2, 2), (6, 3, 3), (6, 4, 3), (6, 8, 6), (7, 4, 1), (16, 4, 4), (16, 3, 2)])
def test_the_most_slices_that_divide_the_width_at_most_one_per_server(
        width: int, servers: int, slices: int) -> None:
    assert column_slices(width, servers) == slices


def test_partition_k_of_the_slice_rows_is_column_slice_k_of_every_row() -> None:
    weight = torch.arange(5 * 6, dtype=torch.float64).view(5, 6)
    rows = slices_view(weight, 3)
    partitioning = RowPartitioning(rows.shape[0], 3, (0, 2, 4))
    for k, rank in enumerate((0, 2, 4)):
        ids = partitioning.rows_of_server(k)
        assert (partitioning.owner_rank(ids) == rank).all()
        assert torch.equal(rows[ids], weight[:, 2 * k:2 * k + 2])  # in the shard's order
    assert rows.data_ptr() == weight.data_ptr()  # a view: no copy


def test_a_recipe_of_whole_rows_makes_the_slice_rows_of_any_ids() -> None:
    weight = torch.randn(7, 6, dtype=torch.float64)
    rows = slices_of_rows(lambda ids: weight[ids], 2)
    ids = torch.tensor([13, 0, 5, 6, 1])
    assert torch.equal(rows(ids), slices_view(weight, 2)[ids])


def _pieces(whole: torch.Tensor, moment: torch.Tensor, slices: int,
            servers: int) -> list[dict[str, Any]]:
    """A checkpoint's files of ``whole`` held as ``slices`` column slices over ``servers``."""
    partitioning = RowPartitioning(whole.shape[0] * slices, slices, tuple(range(servers)))
    out = []
    for server in range(servers):
        ids = partitioning.rows_of_server(server)
        out.append({"ids": ids, "values": slices_view(whole, slices)[ids],
                    "state": {"exp_avg": slices_view(moment, slices)[ids]},
                    "scalars": {"step": torch.tensor(4.0)}})
    return out


@pytest.mark.parametrize(("saved", "held"), [(2, 3), (3, 1), (1, 2), (2, 2)])
def test_a_checkpoint_of_some_slices_loads_into_any_other_count(saved: int, held: int) -> None:
    whole = torch.randn(5, 6, dtype=torch.float64)
    moment = torch.randn(5, 6, dtype=torch.float64)
    pieces = _pieces(whole, moment, saved, servers=saved)
    info = {"num_rows": 5 * saved, "row_shape": [6 // saved]}
    table = SimpleNamespace(num_rows=5 * held, row_shape=(6 // held,), dtype=torch.float64,
                            device=torch.device("cpu"))
    got = _in_rows_of(table, info, pieces)  # type: ignore[arg-type]
    if saved == held:
        assert got is pieces  # the same rows: the files' pieces as they are
        return
    assert len(got) == 1 and torch.equal(got[0]["ids"], torch.arange(5 * held))
    assert torch.equal(got[0]["values"], slices_view(whole, held))
    assert torch.equal(got[0]["state"]["exp_avg"], slices_view(moment, held))
    assert got[0]["scalars"] == {"step": torch.tensor(4.0)}
