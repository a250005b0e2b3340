"""Each rank's resident memory (VmRSS) and its peak so far (VmHWM) at the points of a run where
the hybrid's memory changes: after the model is built, after `get_runner`, after each step,
and around each table's move between placements (`parallax.partitions.repartition._move`, which
moving a table onto its owner after the warm-up goes through). A probe, not a timed benchmark:
where a peak comes from, not how long a step takes.

    parallax run --machines 2 --nproc-per-machine 2 --emulate-network 1gbit \\
        benchmarks/memory_trace.py '{"history": 32, "hash_multiplier": 1000}' [STEPS]

The argument is the recommender's workload options (`benchmarks/workloads.py`); the model is
built in ``parallax.meta_init()`` and trained with Adagrad and the default `Config`, as
`compare.py`'s ``hybrid`` system runs it, on synthetic batches. One line per point and rank:
``[memory rank R] POINT: rss MiB, peak MiB``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from workloads import Workload  # noqa: E402

import parallax  # noqa: E402
from parallax.engine.optimizers.shard_optimizer import ShardOptimizer  # noqa: E402
from parallax.partitions import repartition  # noqa: E402


def memory_mib() -> tuple[int, int]:
    """This process's resident memory and its peak so far, in MiB (/proc/self/status)."""
    values = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0]) // 1024
    return values["VmRSS"], values["VmHWM"]


def report(point: str) -> None:
    rss, peak = memory_mib()
    print(f"[memory rank {os.environ.get('RANK', '0')}] {point}: {rss} MiB, peak {peak} MiB",
          flush=True)


def traced_moves() -> None:
    """Report around every table move (the function the hybrid's placement changes use), and
    inside it: after its rows are read, after its optimizer state is read, when the new shard
    is set and when the optimizer holds the carried state."""
    move = repartition._move

    def reported(table, *args, **kwargs):  # type: ignore[no-untyped-def]
        report(f"before moving {table.name}")
        move(table, *args, **kwargs)
        report(f"after moving {table.name}")

    repartition._move = reported
    read = repartition._read_in_rounds

    def read_reported(table, ids, source=None, **kwargs):  # type: ignore[no-untyped-def]
        rows = read(table, ids, source, **kwargs)
        report(f"  read {'state' if source is not None else 'values'} of {table.name}")
        return rows

    repartition._read_in_rounds = read_reported
    repartitioned = ShardOptimizer.table_repartitioned

    def repartitioned_reported(self, table, *args, **kwargs):  # type: ignore[no-untyped-def]
        report(f"  new shard of {table.name} set")
        repartitioned(self, table, *args, **kwargs)
        report(f"  optimizer state of {table.name} carried")

    ShardOptimizer.table_repartitioned = repartitioned_reported  # type: ignore[method-assign]


def main() -> None:
    options = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {"history": 32,
                                                                  "hash_multiplier": 1000}
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 7
    traced_moves()
    workload = Workload("recsys", options)
    report("start")
    # PARALLAX_TRACE_EAGER=1: built as the single-device program builds it (compare.py's
    # ``-eager`` systems), not in parallax.meta_init()
    eager = os.environ.get("PARALLAX_TRACE_EAGER", "") not in ("", "0")
    model, optimizer = workload.model_and_optimizer(False, deferred=not eager)
    report("built")
    runner = parallax.get_runner(model, optimizer, workload.loss,
                                 config=parallax.Config(partition_cache=None))
    report("get_runner")
    generator = torch.Generator().manual_seed(0)
    for step in range(1, steps + 1):
        runner.step(workload.batch(generator))
        report(f"step {step}")
    parallax.shutdown()


if __name__ == "__main__":
    main()
