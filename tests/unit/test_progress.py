"""Per-rank progress records: which rank a failed collective waited for (unit level; the
multi-process cases are in test_errors.py)."""

from __future__ import annotations

import time
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


class _SlowStore(dist.Store):
    """A store whose writes take 0.2 s (a far launcher), recording every value written."""

    def __init__(self) -> None:
        super().__init__()
        self.values: dict[str, bytes] = {}
        self.written: list[str] = []

    def set(self, key: str, value) -> None:
        time.sleep(0.2)
        data = value.encode() if isinstance(value, str) else bytes(value)
        self.values[key] = data
        self.written.append(key)

    def get(self, key: str) -> bytes:
        return self.values[key]

    def check(self, keys: list[str]) -> bool:
        return all(key in self.values for key in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.values[key] for key in keys]

    def set_timeout(self, timeout: timedelta) -> None:
        pass


def test_records_are_written_off_the_steps_path_latest_first() -> None:
    """A step does not wait for the store: three records cost no round trip, the latest one
    is what the store ends up with, and reading the records waits for it."""
    store = _SlowStore()
    zero, one = (Progress(rank, 2, 20.0, store=store) for rank in range(2))
    began = time.perf_counter()
    for step in (1, 2, 3):
        zero.begin(step)
        zero.phase(step, "backward")
        zero.done(step)
    assert time.perf_counter() - began < 0.2 * 3, "a step waited for the store's writes"
    one.begin(1)
    records = one.records()
    assert (records[0].step, records[0].phase) == (3, "done")  # the latest record
    assert store.written.count("parallax/progress/rank0") < 9  # superseded ones were skipped
    zero.finish()
    assert zero.writer is None and one.records()[0].phase == "ended"


def test_an_idle_writer_holds_no_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each run's records have a writer; an idle one lets its thread end and starts another
    with the next record (a process holding many runs keeps no idle threads)."""
    import threading

    from parallax.engine.diagnostics.progress import RecordWriter

    monkeypatch.setattr(RecordWriter, "IDLE_S", 0.05)
    store = dist.HashStore()
    writer = RecordWriter(store, "k")

    def alive() -> int:
        return sum(t.name == "parallax k records" for t in threading.enumerate())

    for value in ("a", "b"):
        writer.put(value)
        writer.flush()
        assert store.get("k") == value.encode()
        deadline = time.monotonic() + 2
        while alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert alive() == 0
