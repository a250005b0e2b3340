"""Worker of benchmarks/compare.py: trains the workload under each system in turn, inside one
group of processes, and records step times, the bytes on this machine's link, peak memory and,
for parallax systems, the plan's α_model and Table 3 prediction.

Systems: parallax's four architectures, and PyTorch DDP over the whole model with a
dense-gradient embedding (what most users run) or with ``sparse=True`` (gloo AllReduces the
sparse gradient). Run through ``parallax run --emulate-network``; arguments come as JSON.
What each recorded field means is in benchmarks/compare.py's docstring.
"""

from __future__ import annotations

import gc
import json
import math
import os
import re
import resource
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))

from profile_callers import callers_of, report, trace_events  # noqa: E402
from quality import train_to_target  # noqa: E402
from thread_cpu import THREAD_KINDS, cpu_profile, thread_cpu_s  # noqa: E402
from workloads import Workload  # noqa: E402

import parallax  # noqa: E402
from parallax.cluster import current_worker  # noqa: E402
from parallax.engine.optimizers.shard_optimizer import state_to_params_device  # noqa: E402
from parallax.launch.fast_exit import exit_now  # noqa: E402
from parallax.planning.memory import predict_memory  # noqa: E402
from parallax.step.forward import to_device  # noqa: E402

PARALLAX_ARCHITECTURES = ("hybrid", "optps", "ps", "allreduce")
MAX_ALPHA_STEPS = 5  # Config's default warm-up: more steps only delay the plan
MAX_SETTLING_STEPS = 64  # a trial or search still running after this many extra steps is timed
CPU_PROFILE_STEPS = 50  # --cpu-profile: steps under cProfile after the timed ones
LOSS_STEPS = 10  # loss_last: the mean training loss over this many last timed steps
# system variant -> dense_sync
DENSE_SYNCS = {"plump": "plump", "qsgd": "qsgd", "slim": "slim", "flat": "flat"}
# Config.local_aggregation by variant (others: None, the architecture's rule)
LOCAL_AGGREGATION = {"direct": False, "aggregated": True}


def link_bytes() -> int:
    stats = Path("/sys/class/net/eth0/statistics")
    if not stats.exists():  # not in an emulated machine: nothing to read
        return 0
    return int((stats / "tx_bytes").read_text()) + int((stats / "rx_bytes").read_text())


def reset_peak_rss() -> bool:
    """Restart this process's peak-RSS count (VmHWM) from its current RSS, so that the peak
    read after a system is that system's, not the process lifetime's. False where the kernel
    does not allow it (not Linux): the peak then covers the process lifetime."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def rss_mib() -> float:
    """This process's resident set size now, MiB."""
    match = re.search(r"^VmRSS:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    return int(match.group(1)) / 1024 if match else 0.0


def peak_rss_mib() -> float:
    """This process's peak resident set size, MiB: VmHWM (resettable), else ru_maxrss."""
    try:
        match = re.search(r"^VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    except OSError:
        match = None
    if match:
        return int(match.group(1)) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def make_step(system: str, workload: Workload, alpha_steps: int,
              ) -> tuple[Callable[[Any], Any], parallax.Runner | None, int | None]:
    """A ``step(batch) -> loss`` for ``system``, built from the same single-device program,
    the parallax runner behind it (None for DDP and TorchRec) and, but for TorchRec, the bytes
    this rank holds for training by the memory model (`parallax.planning.memory`).
    ``plain`` is the single-device program's own loop (one worker: the baseline of parallax's
    single-worker overhead); ``local`` the same loop on every worker at once, each on its own
    batch, nothing exchanged (the step's no-exchange compute bound on this host; with
    ``-sparse`` the program's sparse-gradient embeddings, so each optimizer step touches only
    the rows read, as the servers' updates do). ``-sparse`` systems run the program with
    ``sparse=True`` embeddings, ``-lazy`` ones the dense-gradient program with
    ``Config(lazy_sparse_updates=True)``, ``-direct`` ones ``Config(local_aggregation=False)``,
    ``-aggregated`` ones ``Config(local_aggregation=True)``,
    ``-eager`` ones the model built as the single-device program builds it (not in
    ``parallax.meta_init()``: every worker materialises every table first),
    ``-late`` ones ``Config(overlap_push=False)`` (gradient rows pushed after the backward);
    ``-pooled`` ones ``Config(pooled_tables=workload.long_bags)``, ``-rows`` ones
    ``Config(pooled_tables=())`` (no table pooled; by default the hybrid decides),
    ``-tablewise`` ones pool every bag table (``workload.bag_tables``), ``-byrows`` ones
    the long bags by rows (``Config.pooled_by_rows``) and the other bag tables table-wise;
    ``-noopau`` ones ``Config(after_aggregation="workers")``, ``-noopsw`` ones
    ``Config(id_dedup="servers")`` (seed 001's operation placements moved back);
    ``-plump``, ``-qsgd``, ``-slim`` ones that ``Config.dense_sync`` (defaults of `QSGD` and
    `SlimDP`; plump/slim need the LM's ``momentum`` optimizer: SGD);
    ``torchrec-*`` the recommender as a TorchRec EmbeddingBagCollection, or the LM as an
    EmbeddingCollection (row- or table-wise sharded). A parallax system's variants combine
    with ``+`` (``hybrid-aggregated+pooled``: `VARIANT_FLAGS`)."""
    if system.startswith("torchrec"):
        from torchrec_peer import make_torchrec_step

        return (make_torchrec_step(system, workload.cfg, lr=workload.lr, seed=workload.seed),
                None, None)
    architecture, _, variant = system.partition("-")
    flags = set(variant.split("+")) if variant else set()  # e.g. "hybrid-direct+rows"
    sparse_grad = "sparse" in flags
    # parallax systems build the model in parallax.meta_init(), as a program with tables
    # larger than a worker would: each server makes its own rows (DDP needs them all);
    # ``-eager`` ones as the single-device program does (every worker builds every table)
    # "plain" and "local" run the single-device loop itself: no DDP, nothing exchanged
    unsynchronised = system == "plain" or architecture == "local"
    baseline = system.startswith("ddp") or unsynchronised
    model, optimizer = workload.model_and_optimizer(
        sparse_grad=sparse_grad, deferred=not baseline and "eager" not in flags)
    if baseline:
        if system == "plain" and current_worker().world_size != 1:
            raise ValueError("system 'plain' (the single-device loop) runs on one worker only; "
                             "'local' runs it on every worker")
        # the baselines run where parallax's worker runs: its GPU where it has one
        device = current_worker().device
        model.to(device)
        state_to_params_device([optimizer])
        ddp = model if unsynchronised else DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None)

        def step(batch):
            inputs, targets = to_device(batch, device)
            inputs = inputs if isinstance(inputs, tuple) else (inputs,)
            optimizer.zero_grad(set_to_none=True)
            loss = workload.loss(ddp(*inputs), targets)
            loss.backward()
            optimizer.step()
            return loss

        step.model = model  # type: ignore[attr-defined]  (for evaluation: quality.py)
        held = predict_memory(model, {}, {}, [optimizer], uses_ddp=not unsynchronised).total
        return step, None, held
    if architecture not in PARALLAX_ARCHITECTURES:
        raise ValueError(f"unknown system {system!r}")
    runner = parallax.get_runner(model, optimizer, workload.loss,
                                 config=parallax_config(architecture, flags, workload,
                                                        alpha_steps))
    return runner.step, runner, None


def spread(times: list[float]) -> dict[str, float]:
    """Min, 10th and 90th percentile and max of step times (one step: all four equal)."""
    if len(times) < 2:
        return {"step_min_s": times[0], "step_p10_s": times[0], "step_p90_s": times[0],
                "step_max_s": times[0]}
    deciles = statistics.quantiles(times, n=10, method="inclusive")
    return {"step_min_s": min(times), "step_p10_s": deciles[0], "step_p90_s": deciles[-1],
            "step_max_s": max(times)}


def synced_by(plan: Any) -> dict[str, str]:
    """How the plan synchronises each sparse parameter (``ps``, ``allgatherv``, ...)."""
    return {p.name: p.sync for p in plan.parameters if p.sparse}


def plan_fields(runner: parallax.Runner, system: str, wire: float) -> dict[str, Any]:
    """α_model, the Table 3 prediction for this system's architecture, the engine's own count
    and the ratios (collective: every rank must call it)."""
    architecture = system.partition("-")[0]
    engine = sum(runner.inter_machine_bytes().values())  # per machine and step, like the plan
    plan = runner.plan
    predicted = plan.predicted_total(architecture)
    return {
        "architecture": architecture,
        "alpha_model": plan.alpha_model,
        "alphas": {p.name: p.alpha for p in plan.parameters if p.sparse},
        "synced_by": synced_by(plan),
        "predicted_bytes_per_machine_step": predicted,
        "engine_bytes_per_machine_step": engine,
        # None where the model predicts nothing crosses machines (one machine): no ratio
        "wire_over_predicted": wire / predicted if predicted else None,
        "engine_over_predicted": engine / predicted if predicted else None,
        "local_aggregation": runner.local_aggregation,
    }


def profile(step: Callable[[Any], Any], workload: Workload, generator: torch.Generator,
            system: str, directory: Path, steps: int = 5) -> None:
    """``steps`` more steps under torch.profiler (after the timed ones, so the timing is not
    the profiler's): each rank writes its operators by self CPU time, then the host
    synchronisations (``.item()``/``.tolist()``: ``aten::_local_scalar_dense``, stream
    synchronisations) by the Python lines that asked for them, and rank 0 a Chrome trace, to
    ``directory``. On a GPU worker the CUDA kernels are recorded too."""
    worker = current_worker()
    rank = worker.rank
    directory.mkdir(parents=True, exist_ok=True)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if worker.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, with_stack=True) as prof:
        for _ in range(steps):
            step(workload.batch(generator))
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=45)
    # the callers come from the exported trace (profile_callers says why); rank 0 keeps it
    trace = directory / f"{system}-rank{rank}-trace.json"
    prof.export_chrome_trace(str(trace))
    callers = report(callers_of(trace_events(trace)), steps)
    if rank != 0:
        trace.unlink()
    (directory / f"{system}-rank{rank}.txt").write_text(
        f"{system}, rank {rank}: {steps} steps under torch.profiler\n{table}\n"
        f"host synchronisations by caller ({steps} steps):\n{callers}\n")
    dist.barrier()


def phases_per_rank(runner: Any, world: int) -> dict[str, list[float]]:
    """Each rank's milliseconds per timed step in each of the engine's phases (collective)."""
    mine = runner.stats().get("step phases", {})
    names = sorted(mine)
    values = torch.zeros(len(names), world, dtype=torch.float64)
    values[:, current_worker().rank] = torch.tensor([mine[n] * 1e3 for n in names],
                                                    dtype=torch.float64)
    dist.all_reduce(values)
    return {name: [round(v, 3) for v in values[i].tolist()] for i, name in enumerate(names)}


#: the flags a parallax system's variant may join with "+" (make_step's docstring)
VARIANT_FLAGS = {"sparse", "lazy", "late", "eager", "pooled", "tablewise", "byrows",
                 "bycolumns", "rows", "noopau", "noopsw",
                 *DENSE_SYNCS, *LOCAL_AGGREGATION}


def parallax_config(architecture: str, flags: set[str], workload: Workload,
                    alpha_steps: int) -> parallax.Config:
    """The Config of a parallax system: its architecture and its variant's flags."""
    unknown = flags - VARIANT_FLAGS
    if unknown:
        raise ValueError(f"unknown variant flags {sorted(unknown)}; known: "
                         f"{sorted(VARIANT_FLAGS)}")
    aggregation = [LOCAL_AGGREGATION[f] for f in flags if f in LOCAL_AGGREGATION]
    syncs = [DENSE_SYNCS[f] for f in flags if f in DENSE_SYNCS]
    if "pooled" in flags:
        pooled: tuple[str, ...] | None = workload.long_bags
    elif "tablewise" in flags:
        pooled = workload.bag_tables
    elif "byrows" in flags or "bycolumns" in flags:
        pooled = tuple(n for n in workload.bag_tables if n not in workload.long_bags)
    elif "rows" in flags:
        pooled = ()
    else:
        pooled = None  # the hybrid decides
    return parallax.Config(architecture=architecture, lazy_sparse_updates="lazy" in flags,
                           local_aggregation=aggregation[0] if aggregation else None,
                           overlap_push="late" not in flags, pooled_tables=pooled,
                           pooled_by_rows=workload.long_bags if "byrows" in flags else (),
                           pooled_by_columns=(workload.long_bags if "bycolumns" in flags
                                              else ()),
                           dense_sync=syncs[0] if syncs else "hierarchical",
                           # seed 001's operation placements moved back (ablation.py)
                           after_aggregation="workers" if "noopau" in flags else "servers",
                           id_dedup="servers" if "noopsw" in flags else "workers",
                           sparsity_warmup_steps=alpha_steps)


def data_seed(workload: Workload, rank: int) -> int:
    """The seed of ``rank``'s batches: the same for every system, so that every exact
    system trains on the same data."""
    return 1000 * (1 + workload.seed) + rank


def run_system(system: str, workload: Workload, args: dict) -> dict[str, Any]:
    """Build, warm up and time one system on every rank; the result is the same on all."""
    worker = current_worker()
    steps, warmup = args["steps"], args["warmup"]
    # α is measured over the untimed warm-up steps when there are any (the plan, and hybrid's
    # move of dense-enough tables to AllReduce, happen at its end); with none, in step 1.
    alpha_steps = max(1, min(warmup, MAX_ALPHA_STEPS))
    gc.collect()
    cuda = worker.device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(worker.device)
    rss_scoped = reset_peak_rss()
    baseline = rss_mib()  # what the process holds before this system exists
    try:
        step, runner, held = make_step(system, workload, alpha_steps)
    except Exception as error:  # a peer that cannot run here: record the exact error
        if not system.startswith("torchrec"):
            raise
        return {"system": system, "unavailable": f"{type(error).__name__}: {error}"}
    generator = torch.Generator().manual_seed(data_seed(workload, worker.rank))
    if args.get("quality"):  # time_to_quality.py: every step counts, from the first
        result = train_to_target(system, step, runner, workload, generator, args["quality"])
        if runner is not None:
            result["synced_by"] = synced_by(runner.plan)
        return result
    for _ in range(warmup):
        step(workload.batch(generator))
    settling = 0  # the timed steps run the final plan (after the hybrid's leader-hop trial)
    while runner is not None and not runner.plan_settled and settling < MAX_SETTLING_STEPS:
        step(workload.batch(generator))
        settling += 1
    dist.barrier()
    if runner is not None:
        runner.reset_stats()  # the engine's count then covers the timed steps only
    before, times, losses = link_bytes(), [], []
    cpu_before, threads_before = time.process_time(), thread_cpu_s()
    for _ in range(steps):
        batch = workload.batch(generator)
        start = time.perf_counter()
        loss = step(batch)
        if cuda:  # kernels run after the call returns: the step ends when they have
            torch.cuda.synchronize(worker.device)
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
    cpu_ms = (time.process_time() - cpu_before) * 1e3 / steps
    threads_after = thread_cpu_s()
    dist.barrier()
    sent, peak = link_bytes() - before, peak_rss_mib()
    if args.get("profile_dir"):  # after every count of the timed steps is taken
        profile(step, workload, generator, system, Path(args["profile_dir"]))
    if args.get("cpu_profile_dir"):
        directory = Path(args["cpu_profile_dir"])
        directory.mkdir(parents=True, exist_ok=True)
        cpu_profile(lambda: step(workload.batch(generator)), CPU_PROFILE_STEPS,
                    directory / f"{system}-rank{worker.rank}.prof", f"{system}, rank {worker.rank}")
        dist.barrier()
    # One reduction: this machine's link bytes (its first worker reads them), every rank's
    # step times (summed, then averaged: all ranks wait for each other every step, so they
    # differ only by where each rank's clock starts within the step) and every rank's peak
    # RSS in its own slot.
    world = worker.world_size
    if runner is not None:  # after the warm-up: the plan may have moved tables
        held = runner.predicted_memory().total
    cpu = torch.zeros(world, dtype=torch.float64)
    cpu[worker.rank] = cpu_ms
    dist.all_reduce(cpu)
    by_thread = torch.zeros(len(THREAD_KINDS), world, dtype=torch.float64)
    by_thread[:, worker.rank] = torch.tensor(
        [(threads_after[k] - threads_before[k]) * 1e3 / steps for k in THREAD_KINDS],
        dtype=torch.float64)
    dist.all_reduce(by_thread)
    values = torch.zeros(1 + steps + 2 * world, dtype=torch.float64)
    values[0] = float(sent) if worker.is_server else 0.0
    values[1:1 + steps] = torch.tensor(times, dtype=torch.float64)
    values[1 + steps + worker.rank] = peak
    values[1 + steps + world + worker.rank] = (
        baseline + held / 2**20 if held is not None else float("nan"))
    dist.all_reduce(values)
    # the training loss at the end: this rank's mean over the last timed steps, mean of ranks
    last = torch.tensor(statistics.fmean(losses[-LOSS_STEPS:]), dtype=torch.float64)
    dist.all_reduce(last)
    machines = len(worker.server_ranks)
    step_times = (values[1:1 + steps] / world).tolist()
    median = statistics.median(step_times)
    wire = float(values[0]) / machines / steps
    rss = values[1 + steps:1 + steps + world].tolist()
    predicted = values[1 + steps + world:].tolist()
    per_machine = [sum(r for rank, r in enumerate(rss) if worker.machine_of_rank[rank] == m)
                   for m in range(machines)]
    result: dict[str, Any] = {
        "system": system, "median_step_s": median,
        "items_per_s": world * workload.items / median,
        "unit": workload.unit,
        "wire_bytes_per_machine_step": wire,
        "step_times_s": step_times,
        **spread(step_times),
        "peak_rss_mib": max(rss), "peak_rss_mib_per_rank": rss,
        "peak_rss_mib_per_machine": max(per_machine),
        "predicted_rss_mib": None if math.isnan(max(predicted)) else max(predicted),
        "predicted_rss_mib_per_rank": predicted,
        "peak_rss_scope": "system" if rss_scoped else "process lifetime",
        "isolated": bool(args.get("isolated", False)),
        "steps": steps, "warmup": warmup, "world_size": world, "machines": machines,
        "loss_last": float(last) / world,
        # CPU time (all threads, user + system) per timed step: on a host with fewer cores
        # than processes, the step is bounded by the ranks' CPU time together
        "cpu_ms_per_step_per_rank": [round(c, 2) for c in cpu.tolist()],
        # the same by thread (benchmarks/thread_cpu.py): the loop's, the collectives', the rest
        "cpu_ms_per_step_by_thread": {kind: [round(c, 2) for c in row]
                                      for kind, row in zip(THREAD_KINDS, by_thread.tolist(),
                                                           strict=True)},
    }
    if cuda:  # this rank's peak of tensors allocated on its GPU while this system ran
        result["peak_gpu_mib_rank0"] = torch.cuda.max_memory_allocated(worker.device) / 2**20
        result["device"] = torch.cuda.get_device_name(worker.device)
    if runner is not None:
        result.update(plan_fields(runner, system, wire))
        result["phases_ms_per_rank"] = phases_per_rank(runner, world)
    if getattr(step, "plan", None) is not None:  # TorchRec: each table's sharding, as planned
        from torchrec_peer import plan_summary

        result["torchrec_plan"] = plan_summary(step.plan)
    return result


def pin_to_core(rank: int) -> int:
    """Pin this process (and the threads it starts) to one of the cores it may run on, by
    rank: the processes of a link-bound run then never migrate mid-step. Returns the core."""
    cores = sorted(os.sched_getaffinity(0))
    core = cores[rank % len(cores)]
    os.sched_setaffinity(0, {core})
    return core


def main() -> None:
    args = json.loads(sys.argv[1])
    worker = current_worker()
    if args.get("pin"):
        pin_to_core(worker.rank)
    # gloo for the harness's own CPU reductions; NCCL for the CUDA tensors of DDP's buckets
    backend = "cpu:gloo,cuda:nccl" if worker.device.type == "cuda" else "gloo"
    if worker.device.type == "cuda":
        torch.cuda.set_device(worker.device)
    dist.init_process_group(backend, timeout=timedelta(seconds=600))
    workload = Workload(args.get("workload_name", "lm"), args["workload"])
    results = []
    for system in args["systems"]:
        if worker.rank == 0:
            print(f"[bench] {system}: running ({args['warmup']} warm-up + {args['steps']} "
                  f"timed steps)", flush=True)
        result = run_system(system, workload, args)
        results.append(result)
        if worker.rank == 0 and "unavailable" not in result and "curve" in result:
            print(f"[bench] {system}: validation loss {result['curve'][-1]['validation_loss']:.3f}"
                  f" after {result['curve'][-1]['step']} steps, "
                  f"{result['curve'][-1]['seconds']:.1f} s", flush=True)
        elif worker.rank == 0 and "unavailable" not in result:
            print(f"[bench] {system}: {result['median_step_s'] * 1e3:.0f} ms/step, peak RSS "
                  f"{result['peak_rss_mib']:.0f} MiB", flush=True)
    if worker.rank == 0:
        Path(args["out"]).write_text(json.dumps(results, indent=1))
    dist.barrier()  # tear the groups down together (a peer still sending can abort gloo)
    parallax.shutdown()


if __name__ == "__main__":
    main()
    exit_now()  # parallax.launch.fast_exit: no second of teardown per worker
