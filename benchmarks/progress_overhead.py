"""Cost of the per-step progress records (parallax.engine.diagnostics.progress): the store
operations one training step adds (a check for ended ranks, and the forward / backward / done
writes), timed against a TCPStore served by another process, as the launcher's agent serves it.

    python benchmarks/progress_overhead.py [--steps 5000]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import compare  # noqa: E402
import records

from parallax.cluster import free_port
from parallax.engine.diagnostics.progress import Progress


def serve(port: int, stop: multiprocessing.Event) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=30))
    stop.wait()
    del store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5000)
    args = parser.parse_args()
    port, stop = free_port(), multiprocessing.Event()
    server = multiprocessing.Process(target=serve, args=(port, stop))
    server.start()
    store = dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=30))
    progress = Progress(0, 2, 60.0, store=store)
    rounds = []
    for _ in range(5):
        began = time.perf_counter()
        for step in range(1, args.steps + 1):
            progress.begin(step)
            progress.phase(step, "backward")
            progress.done(step)
        rounds.append((time.perf_counter() - began) / args.steps * 1e6)
    progress.finish()  # while the store is still served
    stop.set()
    server.join()
    print(f"progress records: {statistics.median(rounds):.1f} us per step (median of 5 rounds "
          f"of {args.steps} steps; min {min(rounds):.1f}, max {max(rounds):.1f})")
    out = records.scratch() / "progress_overhead.json"
    out.write_text(json.dumps({"us_per_step_median": statistics.median(rounds),
                               "us_per_step_rounds": rounds, "steps_per_round": args.steps,
                               "provenance": compare.provenance()}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
