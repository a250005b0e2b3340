"""Per-rank progress records: which rank a failed collective waited for (unit level; the
multi-process cases are in test_errors.py)."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from parallax.engine.diagnostics.progress import (
    CULPRIT,
    LostRankError,
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


def test_a_closed_connection_names_the_rank_as_lost_not_hung(store: dist.Store) -> None:
    """gloo's "Connection reset by peer" means the peer process is gone (killed, crashed):
    said so, whatever its last record (a SIGKILL leaves it current)."""
    zero, one = ranks(store, 2)
    for p in (zero, one):
        p.begin(1)
    zero.phase(1, "backward")
    error = zero.explain(RuntimeError("[pair.cc:537] Read error [127.0.0.1]:60628: Connection "
                                      "reset by peer. This is typically caused by..."), 1)
    assert isinstance(error, LostRankError) and isinstance(error, StalledRankError)
    assert str(error).startswith("rank 1 is lost: its connection closed while rank 0 waited "
                                 "in step 1 (backward) — it crashed or was killed, it did not "
                                 "hang (its last record: step 1 (forward)")
    assert CULPRIT.match(f"LostRankError: {error}").group(2) == "1"


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


class _HeldStore(dist.Store):
    """A store whose writes wait until the test lets them through."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = dist.HashStore()
        self.open = threading.Event()

    def set(self, key: str, value: str | bytes) -> None:
        self.open.wait(10)
        self.inner.set(key, value)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self.inner.multi_get(keys)

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)


def test_records_are_written_behind_the_step_and_land_before_anyone_reads() -> None:
    """The step does not wait for the store's round trips (a thread sends them, in order);
    reading the records first lets this process's queued writes land; finishing sends the
    last record before the mark that others check."""
    store = _HeldStore()
    zero, one = ranks(store, 2)
    for p in (zero, one):
        p.begin(1)  # returns although no write has landed yet
        p.phase(1, "backward")
    assert not store.inner.check([f"parallax/progress/rank{r}" for r in (0, 1)])
    store.open.set()
    records = zero.records()
    assert (records[0].step, records[0].phase) == (1, "backward") == (records[1].step,
                                                                      records[1].phase)
    one.finish()
    assert not one.writer.thread.is_alive() or one.writer.closed
    with pytest.raises(UnevenInputsError, match="rank 1 ended its training after 0 step"):
        zero.begin(2)


def test_a_rank_dying_of_an_error_is_not_read_as_ended(store: dist.Store,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The chaos soak's case (2x2, async-sparse): rank 0 killed in step 4, rank 3 dies of the
    lost connection and exits; rank 1's explanation must name rank 0, not blame rank 3 for
    uneven inputs (a dying rank's exit used to record the end of its training)."""
    from parallax.engine.diagnostics import failing

    zero, one, two, three = ranks(store, 4)
    for p in (zero, one, two, three):
        for step in (1, 2, 3):
            p.begin(step)
            p.done(step)
        p.begin(4)
    for p in (one, two, three):
        p.phase(4, "backward")
    monkeypatch.setattr(failing, "_failing", True)
    three.finish()  # its process exits with an uncaught LostRankError
    monkeypatch.setattr(failing, "_failing", False)
    lost = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:8626")
    error = one.explain(lost, 4)
    assert isinstance(error, LostRankError) and str(error).startswith("rank 0 is lost"), error
    two.done(4)
    two.begin(5)  # no end of training recorded: the next step does not fail for uneven inputs
    # when the failed rank is the only one missing, it is the one named, as failed
    for p in (zero, one):
        p.phase(4, "backward")
    error = one.explain(lost, 4)
    assert str(error).startswith("rank 3 is lost") and "failed in step 3" in str(error), error


def test_an_uncaught_exception_is_seen_at_exit() -> None:
    import subprocess
    import sys

    program = ("import atexit; from parallax.engine.diagnostics import failing; "
               "failing.watch(); failing.watch(); "
               "atexit.register(lambda: print('failing at exit:', failing.failing())); "
               "raise ValueError('the worker fails')")
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1 and "ValueError: the worker fails" in proc.stderr
    assert "failing at exit: True" in proc.stdout
    calm = subprocess.run([sys.executable, "-c", program.replace(
        "raise ValueError('the worker fails')", "pass")], capture_output=True, text=True,
        timeout=60)
    assert calm.returncode == 0 and "failing at exit: False" in calm.stdout


def test_a_frozen_rank_is_named_where_every_record_shows_the_same_place(
        store: dist.Store) -> None:
    """The chaos soak's case (2x2, SIGSTOP): the stopped rank had recorded the phase its peers
    wait in, so no record is behind; its writer's beat stopped with it."""
    import time

    zero, one, two = ranks(store, 3)
    for p in (zero, one, two):
        p.begin(1)
        p.phase(1, "backward")
    timeout = RuntimeError("[unbound_buffer.cc:129] Timed out waiting 10000ms for send")
    time.sleep(1.2)  # every writer has beaten
    assert zero.explain(timeout, 1) is timeout  # all alive: the failure lies elsewhere
    one.writer.close()  # SIGSTOP: its thread stops with it
    one.writer.thread.join(5)
    zero.store.set("beat1", repr(time.time() - 11.0))  # (under the records' prefix)
    error = zero.explain(timeout, 1)
    assert isinstance(error, StalledRankError) and not isinstance(error, LostRankError)
    assert str(error).startswith("rank 1 did not arrive: rank 0 waited in step 1 (backward")
    assert "no sign of life for 11." in str(error) and "stopped or frozen" in str(error)
    assert CULPRIT.match(f"StalledRankError: {error}").group(2) == "1"


class _Explains:
    """A stand-in `Progress` whose explanation of any error is ``answer`` (or the error)."""

    def __init__(self, answer: BaseException | None) -> None:
        self.answer = answer
        self.asked: list[tuple[str, int]] = []

    def explain(self, error: BaseException, step: int) -> BaseException:
        self.asked.append((str(error), step))
        return self.answer if self.answer is not None else error


def test_the_explainer_explains_a_failed_collective_once_at_the_outermost_use() -> None:
    from parallax.engine.diagnostics.progress import Explainer
    named = StalledRankError("rank 1 did not arrive")
    progress = _Explains(named)
    explained = Explainer(progress, lambda: 7)  # type: ignore[arg-type]
    with pytest.raises(StalledRankError) as caught, explained:
        with explained:
            raise RuntimeError("[gloo] Timed out waiting 1000ms")
    assert caught.value is named and isinstance(caught.value.__cause__, RuntimeError)
    assert progress.asked == [("[gloo] Timed out waiting 1000ms", 7)]
    with pytest.raises(KeyError), explained:  # not a collective's: as it was, unexplained
        raise KeyError("x")
    with pytest.raises(RuntimeError, match="shape mismatch"), explained:
        raise RuntimeError("shape mismatch")
    unexplained = Explainer(_Explains(None), lambda: 1)  # type: ignore[arg-type]
    error = RuntimeError("Connection closed by peer")
    with pytest.raises(RuntimeError) as same, unexplained:
        raise error
    assert same.value is error and len(progress.asked) == 1
    with explained:  # nothing raised: nothing asked, and the depth is back to none
        pass
    assert explained._depth == 0
