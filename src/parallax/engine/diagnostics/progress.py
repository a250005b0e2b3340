"""Every rank's progress in the job's store, so a failed collective names the rank that caused it.

gloo does not say who is missing: when rank 1 hangs, rank 0 fails with "Timed out waiting
20000ms for send operation"; when rank 0 simply ran out of data and exited, rank 1 fails with
"Connection closed by peer ... typically caused by a remote worker crashing". Both point at the
wrong rank. So each rank records, in the store the launcher serves (it outlives the workers),
where it is: the step it began or finished, and that it ended its training. A step first checks
that no rank has ended (uneven inputs fail at once, before any collective); a step whose
collective fails reads every rank's record and raises an error that names the rank that did
not arrive, with its last known step and phase.

Cost: one check per step on the step's path, and three store writes that a thread of this
rank sends behind it (`_Writer`: on a host whose cores the ranks share, each round trip to the
launcher's store waits for that process to be scheduled: the record
progress-writer-recsys-2x2-1gbit). Reading the records first lets this
process's queued writes land. Nothing when the job has one worker.
"""

from __future__ import annotations

import atexit
import contextlib
import queue
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, Store
from torch.distributed import distributed_c10d

from parallax.engine.diagnostics import failing
from parallax.errors import LostRankError, StalledRankError, UnevenInputsError, UsageError

__all__ = ["CULPRIT", "Explainer", "LostRankError", "Progress", "StalledRankError",
           "UnevenInputsError",
           "finish_all", "is_collective_failure"]

_PREFIX = "parallax/progress/"
_ENDED = "ended"
_FAILED = "failed"  # an uncaught exception ended the process (`failing`): not the training
# A step's phases in order: a rank in an earlier phase of the same step is behind.
PHASES = {"forward": 0, "backward": 1, "done": 2}
_READ_TIMEOUT = timedelta(seconds=5)  # reading records after a failure must not hang either


CULPRIT = re.compile(r"^(StalledRankError|LostRankError|UnevenInputsError): rank (\d+) ")
"""How the launcher recognises, in a failed worker's error, the rank that caused it."""


@dataclass(frozen=True)
class Record:
    """One rank's last known place: ``phase`` of ``step`` at wall-clock ``time``."""

    step: int
    phase: str
    time: float

    def describe(self, now: float) -> str:
        where = (f"finished step {self.step}" if self.phase == "done" else
                 f"ended its training after {self.step} step(s)" if self.phase == _ENDED else
                 f"failed in step {self.step}" if self.phase == _FAILED else
                 f"step {self.step} ({self.phase})")
        return f"{where}, {max(0.0, now - self.time):.1f} s ago"


_FLUSH_TIMEOUT_S = 5.0  # waiting for queued writes must not hang either
_BEAT_S = 1.0  # a live rank's writer says so at least this often
_STALE_AFTER_S = 3.0  # (or half the collective timeout) without a beat: the process is frozen


class _Writer:
    """Store writes sent in order by one daemon thread, so that the step does not wait for
    the round trips (c10d's TCPStore serialises its clients' operations, so the step's own
    check may run meanwhile). A write that fails is dropped: the store outlives the workers
    only while the launcher does, and a record is a diagnosis, not the training's state.

    The thread also writes ``beat`` (the time) every `_BEAT_S`: it runs while the rank waits
    in a collective or computes (both release the GIL), so only a frozen process (SIGSTOP, a
    debugger, a deadlock holding the GIL) falls silent, which names it when every rank's
    record shows the same place (`Progress.explain`)."""

    def __init__(self, store: Store, beat: str | None = None) -> None:
        self.store = store
        self.beat = beat
        self.last_beat = 0.0
        self.pending: queue.SimpleQueue[tuple[str, str] | threading.Event | None] = (
            queue.SimpleQueue())
        self.closed = False
        self.thread = threading.Thread(target=self._run, name="parallax-progress", daemon=True)
        self.thread.start()

    def set(self, key: str, value: str) -> None:
        self.pending.put((key, value))

    def flush(self) -> None:
        """Wait (at most `_FLUSH_TIMEOUT_S`) until every write queued so far was sent."""
        if self.closed:
            return
        landed = threading.Event()
        self.pending.put(landed)
        landed.wait(_FLUSH_TIMEOUT_S)

    def close(self) -> None:
        """Send what is queued, then end the thread."""
        self.flush()
        self.closed = True
        self.pending.put(None)

    def _run(self) -> None:
        while True:
            item: tuple[str, str] | threading.Event | None | tuple[()]
            try:
                item = self.pending.get(timeout=_BEAT_S)
            except queue.Empty:
                item = ()  # nothing to send: a beat, if one is due
            if item is None:
                return
            now = time.time()
            if self.beat is not None and now - self.last_beat >= _BEAT_S:
                self.last_beat = now
                with contextlib.suppress(Exception):
                    self.store.set(self.beat, repr(now))
            if isinstance(item, threading.Event):
                item.set()
            elif item:
                with contextlib.suppress(Exception):
                    self.store.set(*item)


class Progress:
    """This rank's records in the job's store (collective-free: each rank writes its own key)."""

    def __init__(self, rank: int, world_size: int, timeout_s: float,
                 store: Store | None = None, *, run: int = 1):
        """``run``: the number of the process's training run (`parallax.runs`, the same on
        every rank): each run's records have keys of their own, so a later run of the
        process never reads an earlier one's."""
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        base = store if store is not None else distributed_c10d._get_default_store()
        self.store: Store | None = PrefixStore(f"{_PREFIX}run{run}/", base)
        self.writer = _Writer(self.store, beat=f"beat{rank}")
        self.steps = 0
        self.ended = False
        self.current = "done"
        # asynchronous training: a worker may finish while others still train
        self.ends_freely = False
        _active.append(self)
        failing.watch()  # a rank dying of an error records that, not the end of its training

    def _write(self, step: int, phase: str) -> None:
        self.current = phase
        if self.store is None:
            raise UsageError(f"rank {self.rank}: parallax was shut down (parallax.shutdown) "
                               "and cannot step any more")
        self.writer.set(f"rank{self.rank}", f"{step}|{phase}|{time.time()!r}")

    def phase(self, step: int, phase: str) -> None:
        """Step ``step`` reached ``phase`` (a key of `PHASES`)."""
        self._write(step, phase)

    def begin(self, step: int) -> None:
        """Before step ``step``'s first collective: fail at once if a rank has ended."""
        if self.store is not None and not self.ends_freely and self.store.check([_ENDED]):
            records = self.records()
            ended = _ended(records)
            if ended:
                raise self._uneven(ended, records, step)
        self._write(step, "forward")

    def done(self, step: int) -> None:
        self.steps = step
        self._write(step, "done")

    def finish(self) -> None:
        """This rank's training is over (shutdown or process exit), or an uncaught exception
        is ending the process (then its peers must not read an end of training: their errors
        would blame uneven inputs)."""
        if self.ended:
            return
        self.ended = True
        failed = failing.failing()
        try:
            self._write(self.steps, _FAILED if failed else _ENDED)
            self.writer.close()  # the record before the mark others check
            if self.store is not None and not failed:
                self.store.set(_ENDED, str(self.rank))
        except Exception:  # the launcher's store may already be gone at interpreter exit
            pass
        # Hold the store no longer than the process group does (a step after shutdown then
        # says so instead of writing to a store the launcher may have closed).
        self.store = None

    def records(self) -> dict[int, Record]:
        """Every rank's last record that the store holds (unreachable store: none)."""
        if self.store is None:
            return {}
        for progress in _active:  # this process's records first (tests run several ranks)
            progress.writer.flush()
        records = {}
        for rank, value in self._per_rank("rank").items():
            step, phase, stamp = value.split("|")
            records[rank] = Record(int(step), phase, float(stamp))
        return records

    def _beats(self) -> dict[int, float]:
        """When each rank's writer last said it is alive (ranks without a beat: absent)."""
        return {rank: float(value) for rank, value in self._per_rank("beat").items()}

    def _per_rank(self, prefix: str) -> dict[int, str]:
        """The value of ``prefix<rank>`` for every rank the store has one of (an unreachable
        store, or none: empty)."""
        if self.store is None:
            return {}
        keys = [f"{prefix}{r}" for r in range(self.world_size)]
        try:
            self.store.set_timeout(_READ_TIMEOUT)
            present = [k for k in keys if self.store.check([k])]
            values = dict(zip(present, self.store.multi_get(present), strict=True))
        except Exception:
            return {}
        return {rank: values[key].decode() for rank, key in enumerate(keys) if key in values}

    def explain(self, error: BaseException, step: int) -> BaseException:
        """The error to raise for a collective of step ``step`` that failed with ``error``:
        one naming the rank(s) that did not arrive, or ``error`` itself when every rank's
        record shows it in this step (the failure lies elsewhere)."""
        records = self.records()
        now = time.time()
        ended = _ended(records)
        if ended:
            return self._uneven(ended, records, step)
        mine = PHASES.get(self.current, 0)
        # a rank that failed too (its record says so) is named only when no other rank is
        failed = sorted(r for r, rec in records.items()
                        if r != self.rank and rec.phase == _FAILED)
        behind = sorted(r for r, rec in records.items()
                        if r != self.rank and r not in failed
                        and (rec.step < step or rec.step == step
                             and PHASES.get(rec.phase, 0) < mine))
        silent = [r for r in range(self.world_size) if r not in records and r != self.rank]
        beats = self._beats()
        stale_after = max(_STALE_AFTER_S, self.timeout_s / 2)
        frozen = sorted(r for r, beat in beats.items()
                        if r != self.rank and r not in failed and now - beat > stale_after)
        culprits = behind or silent or frozen or failed
        if not culprits:
            return error
        first = culprits[0]
        last = records[first].describe(now) if first in records else "no record at all"
        if culprits is frozen and not is_connection_lost(error):
            others = (f" (also silent: rank(s) {', '.join(map(str, culprits[1:]))})"
                      if len(culprits) > 1 else "")
            return StalledRankError(
                f"rank {first} did not arrive: rank {self.rank} waited in step {step} "
                f"({self.current}; collective timeout {self.timeout_s:g} s), and rank "
                f"{first}'s process has given no sign of life for "
                f"{now - beats[first]:.1f} s (its last record: {last}) — it is stopped or "
                f"frozen (SIGSTOP, a debugger, a deadlock holding the GIL){others}. The wait "
                f"ended with: {_first_line(error)}")
        others = (f" (also behind: rank(s) {', '.join(map(str, culprits[1:]))})"
                  if len(culprits) > 1 else "")
        cause = _first_line(error)
        if is_connection_lost(error):
            return LostRankError(
                f"rank {first} is lost: its connection closed while rank {self.rank} waited in "
                f"step {step} ({self.current}) — it crashed or was killed, it did not hang "
                f"(its last record: {last}){others}. The wait ended with: {cause}")
        where = (f"has not called step {step} (a hang or slow work outside parallax, e.g. in "
                 "the training loop or the data loader)"
                 if first not in records or records[first].step < step else
                 f"has not finished the {records[first].phase} of step {step} (a hang or slow "
                 "work in the model or the loss function)")
        return StalledRankError(
            f"rank {first} did not arrive: rank {self.rank} waited in step {step} "
            f"({self.current}; collective timeout {self.timeout_s:g} s), but rank {first}'s "
            f"last record is: {last} — it {where}{others}. The wait ended with: {cause}")

    def _uneven(self, ended: list[int], records: dict[int, Record],
                step: int) -> UnevenInputsError:
        first = ended[0]
        return UnevenInputsError(
            f"rank {first} ended its training after {records[first].step} step(s); rank "
            f"{self.rank} called step {step} — give every worker the same number of batches "
            "(e.g. with parallax.shard, which gives each worker an equal share), or stop all "
            "workers at the same step")


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def _ended(records: dict[int, Record]) -> list[int]:
    """The ranks whose last record says their training ended."""
    return sorted(rank for rank, record in records.items() if record.phase == _ENDED)


_active: list[Progress] = []


def finish_all() -> None:
    """Record that every live `Progress` of this process has ended (shutdown, exit)."""
    while _active:
        _active.pop().finish()


atexit.register(finish_all)


#: what gloo and NCCL say when the process at the other end is gone
_CONNECTION_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
                    "Connection refused", "remote process exited")


def is_connection_lost(error: BaseException) -> bool:
    """Whether a collective failed because a peer's connection closed (it crashed or was
    killed) rather than because the wait ran out of time (a hang, or slow work)."""
    return any(mark in str(error) for mark in _CONNECTION_LOST)


def is_collective_failure(error: BaseException) -> bool:
    """Whether ``error`` came from a collective (gloo/NCCL say so only in their messages)."""
    if isinstance(error, dist.DistError):
        return True
    text = str(error)
    return any(mark in text for mark in ("gloo", "Gloo", "NCCL", "Connection closed by peer",
                                         "Connection reset", "Timed out waiting"))


class Explainer:
    """``with explainer:`` — a failed collective raised inside becomes the error that names
    the rank that is missing (`Progress.explain` for the step ``step()`` says is running);
    nested uses explain once, at the outermost. Nothing to explain with one worker. (The
    object is its own context, a class rather than a generator context: several a step.)"""

    def __init__(self, progress: Progress | None, step: Callable[[], int]) -> None:
        self.progress = progress
        self.step = step
        self._depth = 0

    def __enter__(self) -> None:
        self._depth += 1

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: object) -> None:
        """Anything raised inside goes on (None: not swallowed), explained where it is a
        failed collective of the outermost use."""
        self._depth -= 1
        if error is None:
            return
        # gloo's are RuntimeErrors; an inner use leaves its error to the outermost
        if (not isinstance(error, (RuntimeError, ValueError)) or self._depth > 0
                or self.progress is None or not is_collective_failure(error)):
            return
        explained = self.progress.explain(error, self.step())
        if explained is not error:
            raise explained from error
