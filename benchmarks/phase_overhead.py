"""Cost of the per-step phase timing (parallax.engine.diagnostics.phases), which is always on.

    python benchmarks/phase_overhead.py [--ranges 200000] [--steps 40] [--rounds 5]

1. One phase range (two monotonic clock reads and the self-time bookkeeping) timed in a tight
   loop inside a running step, beside ``torch.profiler.record_function`` with no profiler
   running (records nothing) and with one running (records every operator too).
2. The ranges one LM step opens (the benchmark LM of ``workloads.py``, one worker, its events
   counted with a timeline), and their cost against that step.
3. The same LM steps with phase timing and with it replaced by a no-op, interleaved over
   ``--rounds`` rounds of ``--steps`` steps (medians): the direct comparison, which one
   process's step-time noise bounds.

Writes ``benchmarks/out/phase_overhead.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))

import compare  # noqa: E402
import records  # noqa: E402
from workloads import Workload  # noqa: E402

import parallax  # noqa: E402
from parallax.engine import phases  # noqa: E402


def per_range_us(ranges: int) -> dict[str, float]:
    clock = phases.PhaseClock(0)
    clock.begin(1)
    began = time.perf_counter()
    for _ in range(ranges):
        with clock.phase("forward"):
            pass
    ours = (time.perf_counter() - began) / ranges * 1e6
    clock.end()
    began = time.perf_counter()
    for _ in range(ranges):
        with torch.profiler.record_function("forward"):
            pass
    idle = (time.perf_counter() - began) / ranges * 1e6
    few = max(1, ranges // 20)  # a running profiler keeps every range: fewer
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        began = time.perf_counter()
        for _ in range(few):
            with torch.profiler.record_function("forward"):
                pass
        profiled = (time.perf_counter() - began) / few * 1e6
    return {"phase_clock_us": ours, "record_function_idle_us": idle,
            "record_function_profiling_us": profiled}


def lm_steps(args: argparse.Namespace) -> dict[str, float]:
    os.environ[phases.TIMELINE_ENV] = str(Path(args.scratch) / "trace.json")
    workload = Workload("lm", {"corpus": "zipf", "batch": 16})
    model, optimizer = workload.model_and_optimizer(sparse_grad=False, deferred=True)
    runner = parallax.get_runner(model, optimizer, workload.loss,
                                 config=parallax.Config(partition_cache=None))
    generator = torch.Generator().manual_seed(0)
    for _ in range(8):  # warm-up (and the α measurement)
        runner.step(workload.batch(generator))
    runner.phases.events.clear()
    counted = 10
    for _ in range(counted):
        runner.step(workload.batch(generator))
    ranges = sum(1 for event in runner.phases.events if event[0] != "step") / counted
    runner.phases.timeline = None  # no events kept from here on
    real = phases.PhaseClock.phase

    @contextlib.contextmanager
    def no_op(self, name):  # type: ignore[no-untyped-def]
        yield

    on, off = [], []
    for round_ in range(args.rounds):
        for timed in ((True, False) if round_ % 2 == 0 else (False, True)):
            phases.PhaseClock.phase = real if timed else no_op
            times = []
            for _ in range(args.steps):
                batch = workload.batch(generator)
                began = time.perf_counter()
                runner.step(batch)
                times.append(time.perf_counter() - began)
            (on if timed else off).append(statistics.median(times))
    phases.PhaseClock.phase = real
    parallax.shutdown()
    return {"ranges_per_step": ranges, "step_s_timed": statistics.median(on),
            "step_s_untimed": statistics.median(off), "step_s_timed_rounds": on,
            "step_s_untimed_rounds": off}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranges", type=int, default=200_000)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--scratch", default="/tmp")
    args = parser.parse_args()
    costs = per_range_us(args.ranges)
    steps = lm_steps(args)
    per_step_us = costs["phase_clock_us"] * steps["ranges_per_step"]
    share = per_step_us / 1e6 / steps["step_s_timed"]
    print(f"one phase range: {costs['phase_clock_us']:.2f} us (record_function: "
          f"{costs['record_function_idle_us']:.2f} us with no profiler, "
          f"{costs['record_function_profiling_us']:.2f} us profiling)")
    print(f"LM step (1 worker): {steps['ranges_per_step']:.0f} ranges = {per_step_us:.1f} us of "
          f"a {steps['step_s_timed'] * 1e3:.1f} ms step ({share:.3%}); interleaved A/B: "
          f"{steps['step_s_timed'] * 1e3:.2f} ms timed vs {steps['step_s_untimed'] * 1e3:.2f} "
          f"ms untimed")
    out = records.scratch() / "phase_overhead.json"
    out.write_text(json.dumps({**costs, **steps, "per_step_us": per_step_us,
                               "share_of_step": share, "options": vars(args),
                               "provenance": compare.provenance()}, indent=1))


if __name__ == "__main__":
    main()
