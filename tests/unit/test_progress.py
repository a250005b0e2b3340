"""Per-rank progress records: which rank a failed collective waited for (unit level; the
multi-process cases are in test_errors.py)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from parallax.engine.diagnostics.progress import (
    CULPRIT,
    Progress,
    StalledRankError,
    UnevenInputsError,
)


@pytest.fixture
def store() -> dist.Store:
    return dist.HashStore()


def ranks(store: dist.Store, world: int = 3) -> list[Progress]:
    return [Progress(rank, world, 20.0, store=store) for rank in range(world)]


def test_rank_behind_in_steps_or_phases_is_named(store: dist.Store) -> None:
    zero, one, two = ranks(store)
    for p in (zero, one, two):
        p.begin(1)
        p.done(1)
    zero.begin(2)
    zero.phase(2, "backward")
    two.begin(2)
    two.phase(2, "backward")
    error = zero.explain(RuntimeError("Timed out waiting 20000ms"), 2)
    assert isinstance(error, StalledRankError)
    assert str(error).startswith("rank 1 did not arrive: rank 0 waited in step 2 (backward")
    assert "finished step 1" in str(error) and "has not called step 2" in str(error)
    one.begin(2)  # rank 1 now in the forward of step 2: still behind rank 0's backward
    error = zero.explain(RuntimeError("x"), 2)
    assert "step 2 (forward)" in str(error) and "has not finished the forward" in str(error)
    one.phase(2, "backward")  # everybody in the same place: the failure lies elsewhere
    original = RuntimeError("something else")
    assert zero.explain(original, 2) is original
    assert CULPRIT.match(f"{type(error).__name__}: {error}").group(2) == "1"


def test_ended_rank_fails_the_next_step_at_once(store: dist.Store) -> None:
    zero, one = ranks(store, 2)
    for p in (zero, one):
        p.begin(1)
        p.done(1)
    zero.finish()
    zero.finish()  # twice: harmless
    with pytest.raises(UnevenInputsError, match=r"^rank 0 ended its training after 1 "
                                                r"step\(s\); rank 1 called step 2"):
        one.begin(2)
    assert isinstance(one.explain(RuntimeError("Connection closed by peer"), 2),
                      UnevenInputsError)


def test_a_rank_without_any_record_is_named() -> None:
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=1))
    zero, _ = ranks(store, 2)
    zero.begin(1)
    error = zero.explain(RuntimeError("Timed out"), 1)
    assert str(error).startswith("rank 1 did not arrive") and "no record at all" in str(error)
