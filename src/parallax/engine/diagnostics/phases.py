"""Where a step's time goes: each step split into the phases the engine runs, per rank.

`PhaseClock` times named phases with the process's monotonic clock and keeps each phase's
*self* time (a phase nested in another, e.g. the dense gradients' AllReduce inside the
backward, counts for itself and not for its parent), so the phases of a step add up to the
step. Always on: a phase costs two clock reads and a few dict updates (the cost on the LM is
record phase_overhead). Own clocks rather than ``torch.profiler``'s
``record_function`` ranges: those record nothing unless a profiler is running, and a running
profiler records every operator too (the same record). While a profiler *is*
running (the user's own ``torch.profiler.profile``), each phase is also a
``record_function`` range named ``parallax: PHASE`` (`PROFILER_PREFIX`), so that the user's
trace shows where parallax's part of a step went, among their own operators.

With a timeline file (``parallax run --timeline FILE``, or ``PARALLAX_TIMELINE=FILE`` under
``torchrun``) each phase is also kept as an event; at shutdown every rank hands its events,
as Chrome trace events, to rank 0 through the job's store (so no shared file system is
needed), and rank 0 writes FILE: one process per rank, one thread (track) per phase,
timestamps on the wall clock so that ranks of one host line up.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from parallax.cluster import TIMELINE_ENV
from parallax.engine.diagnostics import failing

__all__ = ["PHASES", "PROFILER_PREFIX", "STATS_KEY", "TIMELINE_ENV", "PhaseClock", "Timed",
           "active", "phase"]

#: the phases of a step, in the order the engine runs them (the progress record: at the
#: step's start, before its backward and at its end)
PHASES = ("id look-ahead", "pull", "pool", "forward", "backward", "dense sync", "push",
          "server aggregation", "clip and check", "server update", "dense update",
          "checkpoint", "progress record")
STATS_KEY = "step phases"  # where `Runner.stats` holds `PhaseClock.per_step`
PROFILER_PREFIX = "parallax: "  # a phase's range in a running torch.profiler's trace
# The profiler's range as one C++ object (inductor's own ranges use it): ``record_function``
# dispatches two operators through Python, about ten calls a range, on every phase of a
# profiled step.
_ProfilerRange = torch._C._profiler._RecordFunctionFast
_STEP = "step"
_GATHER_S = 30.0  # rank 0 waits this long for the other ranks' events at shutdown
log = logging.getLogger("parallax")


class PhaseClock:
    """One runner's phase times (and, with a timeline, its events)."""

    def __init__(self, rank: int, timeline: str | None = None, *, world_size: int = 1,
                 store: Any = None):
        self.rank = rank
        self.timeline = timeline
        self.world_size = world_size
        self.store = store  # the job's (c10d Store): where rank 0 gathers the timeline
        self.seconds: dict[str, float] = defaultdict(float)  # self time since reset
        self.steps = 0
        self.events: list[tuple[str, int, int, int]] = []  # (phase, start ns, ns, step)
        self._top: Timed | None = None  # the innermost running phase (each names its parent)
        self._step = 0
        # whether a profiler runs (then each phase is also its range), read at the step's
        # start: a phase opens several times a step
        self.profiled = False
        self._began: int | None = None  # the running step's start
        self.thread = threading.get_ident()  # phases of other threads are not the step's
        # wall-clock time of a monotonic reading: events go out on the wall clock
        self._wall_minus_mono = time.time_ns() - time.perf_counter_ns()
        self._timed: dict[str, Timed] = {}  # one context per phase name, made once

    def phase(self, name: str) -> Timed:
        """Time ``name`` (its self time: nested phases are subtracted) over a ``with`` block;
        nothing outside a step (an evaluation's pulls are no step's)."""
        try:
            return self._timed[name]
        except KeyError:
            timed = self._timed[name] = Timed(self, name)
            return timed

    def open(self, name: str) -> bool:
        """Start ``name`` where its end is elsewhere (a backward hook, and the callback at the
        backward's end); `close` ends it. False (nothing started) outside a step or while
        ``name`` is already running."""
        return self.phase(name).start()

    def close(self, name: str) -> None:
        """End ``name``, the innermost running phase (nothing if it is not)."""
        top = self._top
        if top is not None and top.name == name:
            top.stop()

    def running(self) -> list[str]:
        """The phases running now, outermost first."""
        names, frame = [], self._top
        while frame is not None:
            names.append(frame.name)
            frame = frame.parent
        return names[::-1]

    def begin(self, number: int) -> None:
        """Step ``number`` starts: its time is the sum of its phases plus what no phase
        covers, until `end`."""
        global _active
        self._step = number
        while self._top is not None:  # a phase a failed step left open is no phase of this one
            self._top.abandon()
        self.profiled = torch._C._autograd._profiler_enabled()
        self._began = time.perf_counter_ns()
        self.thread = threading.get_ident()
        _active = self

    def open_on_step_thread(self, name: str) -> bool:
        """`open` ``name`` if this is the step's thread (a backward runs its hooks on
        autograd's threads, and another thread's backward is not the step's)."""
        return self.thread == threading.get_ident() and self.open(name)

    def after_step(self, done: object) -> None:
        """A step hook (`parallax.step.hooks`): the step's time ends here."""
        self.end()

    def end(self) -> None:
        global _active
        if self._began is None:
            return
        elapsed = time.perf_counter_ns() - self._began
        self.seconds[_STEP] += elapsed / 1e9
        self.steps += 1
        if self.timeline is not None:
            self.events.append((_STEP, self._began, elapsed, self._step))
        self._began = None
        if _active is self:
            _active = None

    def per_step(self) -> dict[str, float]:
        """Seconds per step of each phase (self time), of what no phase covers (``other``)
        and of the whole step, averaged over the steps since the start or `reset`."""
        steps = max(self.steps, 1)
        out = {name: self.seconds.get(name, 0.0) / steps for name in PHASES}
        total = self.seconds.get(_STEP, 0.0) / steps
        out["other"] = max(0.0, total - sum(out.values()))
        out[_STEP] = total
        return out

    def reset(self) -> None:
        self.seconds.clear()
        self.steps = 0

    def write(self) -> Path | None:
        """The timeline at shutdown: this rank's events to rank 0 through the job's store;
        rank 0 writes every rank's (waiting `_GATHER_S` at most: a rank that failed is left
        out, and named); the file's path on rank 0, else None."""
        if self.timeline is None:
            return None
        mine = json.dumps(self._trace_events())
        self.events.clear()
        ranks = {self.rank: mine}
        if self.store is not None and self.world_size > 1:
            try:
                self.store.set(f"parallax/timeline/rank{self.rank}", mine)
                if self.rank != 0:
                    return None
                ranks.update(self._gathered())
            except Exception as error:  # a diagnosis: never what ends a run badly
                log.warning("parallax: rank %d: the timeline could not be gathered: %s",
                            self.rank, error)
        events = [event for rank in sorted(ranks) for event in json.loads(ranks[rank])]
        if not events:  # no rank ran a step
            return None
        path = Path(self.timeline)
        path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
        return path

    def _gathered(self) -> dict[int, str]:
        """At rank 0: the other ranks' events as they arrive in the store (not when this
        process fails: its own error matters more than a complete trace)."""
        keys = {rank: f"parallax/timeline/rank{rank}" for rank in range(1, self.world_size)}
        found: dict[int, str] = {}
        deadline = time.monotonic() + _GATHER_S
        while keys and time.monotonic() < deadline and not failing.failing():
            for rank, key in list(keys.items()):
                if self.store.check([key]):
                    found[rank] = self.store.get(key).decode()
                    del keys[rank]
            if keys:
                time.sleep(0.05)
        if keys:
            log.warning("parallax: the timeline leaves out rank(s) %s: no events from them "
                        "within %g s (failed, or still training)",
                        ", ".join(map(str, sorted(keys))), _GATHER_S)
        return found

    def _trace_events(self) -> list[dict[str, Any]]:
        """This rank's events as Chrome trace events (with its process and track names;
        none without a step)."""
        if not self.events:
            return []
        tracks = {name: i for i, name in enumerate((_STEP, *PHASES))}
        events = [{"name": "process_name", "ph": "M", "pid": self.rank,
                   "args": {"name": f"rank {self.rank}"}},
                  {"name": "process_sort_index", "ph": "M", "pid": self.rank,
                   "args": {"sort_index": self.rank}}]
        events += [{"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid,
                    "args": {"name": name}} for name, tid in tracks.items()]
        events += [{"name": name, "cat": "parallax", "ph": "X", "pid": self.rank,
                    "tid": tracks.get(name, len(tracks)),
                    "ts": (start + self._wall_minus_mono) / 1e3, "dur": ns / 1e3,
                    "args": {"step": step}} for name, start, ns, step in self.events]
        return events


_active: PhaseClock | None = None


def active() -> PhaseClock | None:
    """The clock of the step running in this process, if any."""
    return _active


def phase(name: str) -> Timed:
    """Time ``name`` on the running step's clock over a ``with`` block (nothing outside a
    step): for engine code that runs inside a step without holding the runner (pulls in a
    lookup, comm hooks)."""
    clock = _active
    if clock is None or clock.thread != threading.get_ident():
        return _NOT_TIMED
    try:  # (the clock's own context, read here: a call fewer, several a step)
        return clock._timed[name]
    except KeyError:
        return clock.phase(name)


class Timed:
    """``with`` blocks timed as the phase ``name`` of ``clock`` (None: not timed); one per
    clock and name, made once and reused, nested in itself as well (its outermost block is
    the phase). While it runs it is a frame of the clock's stack of running phases (its
    ``parent`` the one it runs in). A class, not a generator context manager: phases open
    several times a step, and each generator context costs about twice the Python calls."""

    __slots__ = ("children", "clock", "depth", "name", "opened", "parent", "ranged", "running",
                 "began")

    def __init__(self, clock: PhaseClock | None, name: str) -> None:
        self.clock = clock
        self.name = name
        self.depth = 0  # blocks of this context running
        self.opened = False  # its outermost block started the phase
        self.running = False  # the phase runs (opened by a block or by `PhaseClock.open`)
        self.parent: Timed | None = None
        self.began = 0  # its start, ns
        self.children = 0  # ns its nested phases took
        self.ranged: Any = None  # its profiler range, while a profiler runs

    def __enter__(self) -> None:
        if self.clock is None:
            return
        self.depth += 1
        if self.depth == 1:
            self.opened = self.start()

    def __exit__(self, *exc_info: object) -> None:
        if self.clock is None:
            return
        self.depth -= 1
        if self.depth == 0 and self.opened:
            self.opened = False
            if self.clock._top is self:  # (else an inner phase left open: `close` skips it)
                self.stop()

    def start(self) -> bool:
        """Start the phase; False (nothing started) outside a step or while it runs."""
        clock = self.clock
        if clock is None or clock._began is None or self.running:
            return False
        self.running = True
        if clock.profiled:
            self.ranged = _ProfilerRange(PROFILER_PREFIX + self.name)
            self.ranged.__enter__()
        self.parent, clock._top = clock._top, self
        self.children = 0
        self.began = time.perf_counter_ns()
        return True

    def stop(self) -> None:
        """End the phase, the innermost running one: its self time, its parent's children's."""
        elapsed = time.perf_counter_ns() - self.began
        clock = self.clock
        if clock is None:  # (only a started phase stops)
            return
        clock._top, self.parent = self.parent, None
        self.running = False
        if self.ranged is not None:
            self.ranged.__exit__(None, None, None)
            self.ranged = None
        clock.seconds[self.name] += (elapsed - self.children) / 1e9
        if clock._top is not None:
            clock._top.children += elapsed
        if clock.timeline is not None:
            clock.events.append((self.name, self.began, elapsed, clock._step))

    def abandon(self) -> None:
        """Leave the clock's stack untimed (a step that failed left it running; a block of
        it still open ends without timing it)."""
        clock = self.clock
        if clock is None:
            return
        clock._top, self.parent = self.parent, None
        self.running = False
        if self.ranged is not None:
            self.ranged.__exit__(None, None, None)
            self.ranged = None


_NOT_TIMED = Timed(None, "")  # a phase outside a step, or on another thread
