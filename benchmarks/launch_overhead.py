"""What a short ``parallax run`` spends outside training: the launcher's start, the workers'
start-up (Python, torch, parallax, ``get_runner``), and the end (the workers' exit and the
launcher's own).

    python benchmarks/launch_overhead.py [--machines 1] [--nproc-per-machine 2] [--repeats 7]
                                         [--emulate-network RATE] [--label NAME] [--out FILE]
                                         [--no-warm-up]

Each repeat launches ``launch_worker.py`` (a tiny embedding model, one step) and takes wall-clock
marks: the command's start, each worker's first line, its runner built, its step done, its
``parallax.shutdown()`` returned, and the command's end; and the CPU seconds of every process
of the launch (``getrusage`` of the children: on a host of few cores, CPU is what a suite of
launches waits for). Medians over the repeats (the spread as min-max). Compare two versions of
the library by running this file from one checkout with ``PYTHONPATH=<other checkout>/src``
and another ``--label``. Writes (appends to) ``benchmarks/out/launch_overhead.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import compare  # noqa: E402
import records  # noqa: E402

PARTS = ("launcher start", "worker start-up", "get_runner", "one step", "shutdown", "end")


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def one_launch(machines: int, per_machine: int, rate: str | None = None) -> dict[str, float]:
    """Seconds of each part of one launch (from the slowest worker's marks, so that the
    parts add up to the total), and its CPU seconds. ``rate``: each machine in a network
    namespace with that link (``--emulate-network``)."""
    network = ["--emulate-network", rate] if rate else []
    cpu = _children_cpu_s()
    began = time.time()
    proc = subprocess.run([sys.executable, "-m", "parallax.cli", "run", "--machines",
                           str(machines), "--nproc-per-machine", str(per_machine), *network,
                           str(HERE / "launch_worker.py")],
                          capture_output=True, text=True, timeout=300)
    ended = time.time()
    cpu = _children_cpu_s() - cpu
    if proc.returncode != 0:
        raise SystemExit(f"launch failed:\n{proc.stderr[-3000:]}")
    # the workers' lines may run into each other in the launcher's output
    marks = [json.loads(mark) for mark in re.findall(r"\[launch\] (\{[^}]*\})", proc.stdout)]
    if len(marks) != machines * per_machine:
        raise SystemExit(f"expected {machines * per_machine} workers' marks:\n{proc.stdout}")
    first = min(m["start"] for m in marks)
    start_up, runner = max(m["imported"] for m in marks), max(m["runner"] for m in marks)
    stepped, shut = max(m["stepped"] for m in marks), max(m["shutdown"] for m in marks)
    return {"launcher start": first - began, "worker start-up": start_up - first,
            "get_runner": runner - start_up, "one step": stepped - runner,
            "shutdown": shut - stepped, "end": ended - shut, "total": ended - began,
            "cpu": cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--machines", type=int, default=1)
    parser.add_argument("--nproc-per-machine", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--emulate-network", metavar="RATE", default=None,
                        help="each machine in a network namespace (needs root), e.g. 1gbit")
    parser.add_argument("--no-warm-up", action="store_true",
                        help="skip the first launch that warms the page cache (a smoke run)")
    parser.add_argument("--label", default="this checkout")
    parser.add_argument("--out", type=Path, default=records.scratch() / "launch_overhead.json")
    args = parser.parse_args()
    rate = args.emulate_network
    if not args.no_warm_up:
        one_launch(args.machines, args.nproc_per_machine, rate)  # warm the page cache
    runs = []
    for i in range(args.repeats):
        runs.append(one_launch(args.machines, args.nproc_per_machine, rate))
        print(f"[launch] {i + 1}/{args.repeats}: {runs[-1]['total']:.2f} s, "
              f"{runs[-1]['cpu']:.2f} CPU s", flush=True)
    summary = {part: {"median_s": statistics.median(r[part] for r in runs),
                      "min_s": min(r[part] for r in runs), "max_s": max(r[part] for r in runs)}
               for part in (*PARTS, "total", "cpu")}
    record = {"label": args.label, "machines": args.machines,
              "nproc_per_machine": args.nproc_per_machine, "repeats": args.repeats,
              "emulate_network": rate,
              "parts": summary, "provenance": compare.provenance(),
              # the library that ran, when not this checkout's
              "pythonpath": os.environ.get("PYTHONPATH")}
    earlier = json.loads(args.out.read_text()) if args.out.exists() else []
    args.out.write_text(json.dumps([*earlier, record], indent=1))
    print(f"| {args.label} | " + " | ".join(f"{summary[p]['median_s']:.2f}"
                                            for p in (*PARTS, "total", "cpu")) + " |")


if __name__ == "__main__":
    main()
