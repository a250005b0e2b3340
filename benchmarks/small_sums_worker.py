"""Worker of small_sums.py: CPU and wall time per call of each way to sum a payload over all
ranks, and of a bare all_to_all (what a pull's count message costs). Rank 0 writes the
records to the JSON file named by its argument.

Usage: parallax run --machines 2 --nproc-per-machine 2 --emulate-network 1gbit \
           small_sums_worker.py OUT.json CALLS SIZE [SIZE ...]"""

import json
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import parallax
from parallax.cluster import current_worker
from parallax.engine.tables import hierarchy, reduction
from parallax.launch.fast_exit import exit_now
from parallax.session import join


def timed(call: Callable[[], None], calls: int) -> tuple[float, float]:
    """Mean CPU (this process, all threads) and wall milliseconds per call, over the ranks."""
    for _ in range(max(3, calls // 10)):
        call()
    dist.barrier()
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(calls):
        call()
    per = torch.tensor([(time.process_time() - cpu) / calls * 1e3,
                        (time.perf_counter() - wall) / calls * 1e3], dtype=torch.float64)
    dist.all_reduce(per)
    return tuple((per / dist.get_world_size()).tolist())  # type: ignore[return-value]


def main() -> None:
    out, calls, sizes = sys.argv[1], int(sys.argv[2]), [int(s) for s in sys.argv[3:]]
    worker = current_worker()
    join(worker, parallax.Config(collective_timeout_s=120))
    records = []
    for size in sizes:
        payload = torch.ones(size)
        schemes = {"flat ring": lambda p=payload: dist.all_reduce(p),
                   "machine by machine": lambda p=payload: hierarchy.all_reduce(p),
                   "one all_to_all": lambda p=payload: reduction.all_reduce(p, all_to_all=True)}
        for scheme, call in schemes.items():
            cpu, wall = timed(call, calls)
            records.append({"float32s": size, "scheme": scheme, "cpu_ms": cpu, "wall_ms": wall})
    counts = torch.zeros(worker.world_size * 3, dtype=torch.long)
    received = torch.empty_like(counts)
    cpu, wall = timed(lambda: dist.all_to_all_single(received, counts), calls)
    records.append({"float32s": 0, "scheme": "count message (all_to_all of 3 int64s)",
                    "cpu_ms": cpu, "wall_ms": wall})
    if worker.rank == 0:
        with open(out, "w") as f:
            json.dump(records, f)
    parallax.shutdown()
    exit_now(0)


if __name__ == "__main__":
    main()
