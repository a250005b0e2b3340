"""Worker of benchmarks/async_training.py: trains the workload under each synchronisation mode
in turn (sync, async-sparse, async), inside one group of processes, and records every step's
end time and training loss on every rank.

Work is the same in every mode: ``steps`` per worker under sync and async-sparse (their steps
are aligned), and ``steps x workers`` steps in all under async, whichever workers do them
(each worker stops once the workers' clocks sum to that: a fast worker does more). With
``straggler`` the last rank sleeps twice its own step time after each step (3x slower).
Run through ``parallax run --emulate-network``; arguments come as JSON.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workloads import Workload  # noqa: E402

import parallax  # noqa: E402
from parallax.cluster import current_worker  # noqa: E402
from parallax.launch.fast_exit import exit_now  # noqa: E402

MODES = {"sync": dict(sync="sync", architecture="hybrid"),
         "async-sparse": dict(sync="async-sparse", architecture="hybrid"),
         "async": dict(sync="async", architecture="ps")}


def run_mode(mode: str, workload: Workload, args: dict) -> dict[str, Any]:
    worker = current_worker()
    world, rank = worker.world_size, worker.rank
    model, optimizer = workload.model_and_optimizer(sparse_grad=False, deferred=True)
    config = parallax.Config(**MODES[mode], partition_cache=None, collective_timeout_s=600,
                             sparsity_warmup_steps=min(5, args["warmup"]) or 1)
    runner = parallax.get_runner(model, optimizer, workload.loss, config=config)
    generator = torch.Generator().manual_seed(1000 + rank)
    for _ in range(args["warmup"]):
        runner.step(workload.batch(generator))
    dist.barrier(group=runner.group)
    straggler = args["straggler"] and rank == world - 1
    steps, target = args["steps"], (args["steps"] + args["warmup"]) * world
    records: list[tuple[float, float]] = []
    start = time.perf_counter()
    done = 0
    while True:
        if mode == "async":
            if runner.workers_steps() >= target:
                break
        elif done >= steps:
            break
        batch = workload.batch(generator)
        began = time.perf_counter()
        loss = float(runner.step(batch))
        if straggler:
            time.sleep(2 * (time.perf_counter() - began))
        records.append((time.perf_counter() - start, loss))
        done += 1
    finished = time.perf_counter() - start
    dist.barrier(group=runner.group)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, {"rank": rank, "finished_s": finished, "steps": done,
                                      "records": records}, group=runner.group)
    return {"mode": mode, "ranks": everyone, "items_per_step": workload.items,
            "unit": workload.unit, "world_size": world,
            "machines": len(worker.server_ranks)}


def main() -> None:
    args = json.loads(sys.argv[1])
    worker = current_worker()
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    workload = Workload(args["workload_name"], args["workload"])
    results = []
    for mode in args["modes"]:
        if worker.rank == 0:
            print(f"[bench] {mode}{' (straggler)' if args['straggler'] else ''}: running",
                  flush=True)
        results.append(run_mode(mode, workload, args))
    if worker.rank == 0:
        Path(args["out"]).write_text(json.dumps(results))
    dist.barrier()
    parallax.shutdown()


if __name__ == "__main__":
    main()
    exit_now()  # parallax.launch.fast_exit: no second of teardown per worker
