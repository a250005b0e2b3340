"""Worker of benchmarks/partitions.py (Table 2 and Table 5 analogs): inside one group of
processes, times the workload at every partition count of a range (brute force, one runner
re-partitioned in process between counts), then trains a fresh copy built inside
``parallax.partitioner()`` until the in-process search has chosen a count, and times that count.
Arguments come as JSON; rank 0 writes the results JSON."""

from __future__ import annotations

import json
import statistics
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

GROUP = "tables"


def timed(runner: parallax.Runner, workload: Workload, generator: torch.Generator,
          steps: int) -> list[float]:
    """Per-step seconds, each the mean over ranks (ranks wait for each other every step)."""
    times = []
    for _ in range(steps):
        batch = workload.batch(generator)
        start = time.perf_counter()
        runner.step(batch)
        times.append(time.perf_counter() - start)
    values = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(values)
    return (values / dist.get_world_size()).tolist()


def summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {"median_step_s": statistics.median(times), "step_min_s": ordered[0],
            "step_max_s": ordered[-1]}


def say(message: str) -> None:
    if dist.get_rank() == 0:
        print(f"[partitions] {message}", flush=True)


def config(args: dict[str, Any], **extra: Any) -> parallax.Config:
    return parallax.Config(sparsity_warmup_steps=args["alpha_steps"], partition_cache=None,
                           server_threads=args.get("server_threads"), **extra)


def brute_force(workload: Workload, args: dict[str, Any]) -> list[dict[str, Any]]:
    model, optimizer = workload.model_and_optimizer(sparse_grad=False)
    runner = parallax.get_runner(model, optimizer, workload.loss, config=config(args))
    generator = torch.Generator().manual_seed(1000 + dist.get_rank())
    for _ in range(args["alpha_steps"]):
        runner.step(workload.batch(generator))
    tables = [p.name for p in runner.plan.parameters if p.sync == "ps"]
    # Rounds over all counts, so that a slow spell of the shared host spreads over the counts
    # instead of landing on a few of them.
    times: dict[int, list[float]] = {p: [] for p in args["partitions"]}
    for round_index in range(args["rounds"]):
        for partitions in args["partitions"]:
            runner.repartition(partitions)
            timed(runner, workload, generator, args["settle"])
            times[partitions] += timed(runner, workload, generator, args["steps"])
            say(f"brute force round {round_index + 1}/{args['rounds']} P={partitions}: "
                f"{statistics.median(times[partitions]) * 1e3:.1f} ms/step so far "
                f"({', '.join(tables)})")
    return [{"partitions": p, **summary(t), "step_times_s": t} for p, t in times.items()]


def searched(workload: Workload, args: dict[str, Any]) -> dict[str, Any]:
    with parallax.partitioner(GROUP, max_partitions=max(args["partitions"])):
        model, optimizer = workload.model_and_optimizer(sparse_grad=False)
    runner = parallax.get_runner(model, optimizer, workload.loss, config=config(
        args, partition_search_steps=args["search_steps"]))
    generator = torch.Generator().manual_seed(2000 + dist.get_rank())
    steps, began = 0, time.perf_counter()
    while GROUP not in runner.partition_searches:
        runner.step(workload.batch(generator))
        steps += 1
        if steps > 500:
            raise RuntimeError("the partition search did not finish within 500 steps")
    wall = time.perf_counter() - began
    record = runner.partition_searches[GROUP]
    after = summary(timed(runner, workload, generator, args["steps"]))
    say(f"searched: P={record.partitions} from {len(record.samples)} samples in "
        f"{record.search_seconds:.1f} s; then {after['median_step_s'] * 1e3:.1f} ms/step")
    return {**record.to_dict(), "steps_until_chosen": steps, "wall_until_chosen_s": wall,
            "alpha_steps": args["alpha_steps"], "after": after}


def main() -> None:
    args = json.loads(sys.argv[1])
    worker = current_worker()
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    workload = Workload(args["workload_name"], args["workload"])
    result = {"brute_force": brute_force(workload, args), "search": searched(workload, args),
              "world_size": worker.world_size, "machines": len(worker.server_ranks),
              "server_threads": args.get("server_threads")}
    if worker.rank == 0:
        Path(args["out"]).write_text(json.dumps(result, indent=1))
    dist.barrier()
    parallax.shutdown()


if __name__ == "__main__":
    main()
    exit_now()  # parallax.launch.fast_exit: no second of teardown per worker
