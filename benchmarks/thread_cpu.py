"""Where a worker's CPU time goes: by thread, and by Python function on the main thread.

On a host with fewer cores than processes a step is bounded by the CPU time of every rank's
threads together, not by any one rank's wall time, so the comparison that explains a step time
is CPU time per step, split by the thread that spent it: the training loop's own thread
(``main``: Python and the operators it calls), the collectives' threads (``gloo``: gloo's
socket loop and c10d's work loop, which copy and send the messages) and the rest (``other``:
parallax's progress writer, server pools, TorchRec's threads).

`thread_cpu_s` reads the kernel's per-thread counters (``/proc/self/task/*/stat``); Python's
``time.process_time`` gives only the sum. `cpu_profile` runs steps under ``cProfile`` timed
by ``time.thread_time``: CPU time, not wall time, so the waits on peers (``work.wait()``, the
collectives' blocking calls) cost nothing there and what is left is what the thread computes;
torch.profiler's wall times cannot separate the two on a shared host.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["THREAD_KINDS", "cpu_profile", "thread_cpu_s"]

THREAD_KINDS = ("main", "gloo", "other")


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds (user + system) this process's threads have spent so far, by kind
    (`THREAD_KINDS`); zeros where ``/proc`` is not there (not Linux)."""
    totals = dict.fromkeys(THREAD_KINDS, 0.0)
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return totals
    ticks = os.sysconf("SC_CLK_TCK")
    main = os.getpid()
    for task in tasks.iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended between the listing and the read
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        seconds = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
        kind = ("main" if int(task.name) == main else
                "gloo" if name.startswith(("gloo", "pt_gloo")) else "other")
        totals[kind] += seconds
    return totals


def cpu_profile(step: Callable[[], object], steps: int, out: Path, title: str) -> None:
    """Run ``step`` ``steps`` times under ``cProfile`` timed by this thread's CPU time and
    write ``out`` (the raw statistics, for ``pstats``) and ``out`` with ``.txt`` (the
    functions by own CPU time and by CPU time including callees, per step)."""
    profiler = cProfile.Profile(time.thread_time)
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    profiler.dump_stats(out)
    stats = pstats.Stats(profiler, stream=io.StringIO())
    calls = sum(entry[1] for entry in stats.stats.values())  # type: ignore[attr-defined]
    text = io.StringIO()
    text.write(f"{title}: {steps} steps under cProfile, timed by the thread's CPU time: "
               f"{stats.total_tt * 1e3 / steps:.2f} ms and {calls / steps:,.0f} Python "
               f"calls per step (the profiler's own cost included)\n")
    for order, rows in (("tottime", 35), ("cumulative", 45)):
        stats.stream = text
        stats.sort_stats(order).print_stats(rows)
    out.with_suffix(".txt").write_text(text.getvalue())
