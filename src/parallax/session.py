"""This process's part in a run: joining the process groups, and leaving them cleanly.

The PS exchange gets its own group (apart from DDP's bucketed AllReduce); `shutdown` destroys
it before the default group (the order measured free of gloo aborts at exit), records that this
rank's training ended (`parallax.engine.diagnostics.progress`), and restores the environment a
one-worker run changed.
"""

from __future__ import annotations

import atexit
import os
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from parallax import logs, runs
from parallax.cluster import EnvironmentPatch, WorkerInfo, current_worker, free_port
from parallax.config import Config
from parallax.engine.diagnostics import progress
from parallax.engine.tables import hierarchy
from parallax.engine.tables.pool import close_shared_pools
from parallax.errors import UnsupportedProgramError
from parallax.parallelism.grid import forget_meshes
from parallax.partitions.groups import group_of
from parallax.runs import TrainingRun

__all__ = ["check_same_everywhere", "join", "live_runners", "on_shutdown", "shutdown",
           "single_process_worker", "track"]

_sparse_group: dist.ProcessGroup | None = None


# Environment variables a one-worker run set, with their earlier values: `shutdown` puts them
# back, or a later launch from this process (a notebook, a test) would inherit RANK=0 and
# WORLD_SIZE=1 and its workers would each believe they are alone.
_environment = EnvironmentPatch()


def single_process_worker() -> WorkerInfo:
    values = {"MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1"),
              "MASTER_PORT": os.environ.get("MASTER_PORT") or str(free_port()),
              "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
              "GROUP_RANK": "0"}
    _environment.set(values)
    worker = current_worker()
    assert worker is not None
    return worker


def join(worker: WorkerInfo, config: Config) -> dist.ProcessGroup:
    """Join the default group (if the program has not) and the group for the PS exchange."""
    global _sparse_group
    logs.configure(worker.rank)
    timeout = timedelta(seconds=config.collective_timeout_s)
    if not dist.is_initialized():
        if worker.device.type == "cuda":
            torch.cuda.set_device(worker.device)
        dist.init_process_group(worker.backend, timeout=timeout)
    if _sparse_group is None:
        # Its own group keeps the PS exchange apart from DDP's bucketed AllReduce.
        _sparse_group = dist.new_group(backend=worker.backend, timeout=timeout)
        hierarchy.join(worker, backend=worker.backend, timeout=timeout)
        atexit.register(shutdown)
    return _sparse_group


_releases: list[Callable[[], Callable[[], object] | None]] = []


def track(runner: object) -> TrainingRun:
    """The training run ``runner`` belongs to (`parallax.runs`: the current one while it has
    not stepped, else a new one) until `shutdown`."""
    return runs.join_run(runner)


def live_runners() -> list[Any]:
    """The runners of this process's current run, oldest first: what a call that names no
    model, such as `parallax.global_mean`, reads the run from."""
    run = runs.current_run()
    return run.runners() if run is not None else []


def on_shutdown(release: Callable[[], object]) -> None:
    """Call ``release`` at `shutdown`, before any process group is destroyed (a runner drops
    its DDP wrapper there; weakly held: a runner already gone is skipped)."""
    _releases.append(weakref.WeakMethod(release) if hasattr(release, "__self__")
                     else (lambda: release))


def shutdown() -> None:
    """Destroy parallax's process groups: the PS group first, then the default group (the order
    that measured free of gloo aborts at exit). Safe to call twice.

    DDP wrappers are released first. A DDP reducer holds its process group; were it the
    last holder, the gloo group would be destroyed from the reducer's destructor, which keeps
    the GIL while it joins gloo's threads, and a gloo thread that needs the GIL to free a
    finished collective then deadlocks the process at exit (pytorch/pytorch#56297; seen
    here as a worker hanging after its last step). Released here, the reducer is never the
    last holder: the group goes in ``destroy_process_group``, which lets go of the GIL."""
    global _sparse_group
    run = runs.current_run()
    progress.finish_all()  # other ranks still stepping now fail at once, naming this one
    while _releases:
        release = _releases.pop()()
        if release is not None:
            release()
    _environment.restore()
    if run is not None:
        run.waiting.clear()  # a resume's positions no loader took are this run's only
    runs.end_run()
    close_shared_pools()
    hierarchy.leave()
    forget_meshes()  # their groups go with the default group below
    if _sparse_group is not None and dist.is_initialized():
        dist.destroy_process_group(_sparse_group)
    _sparse_group = None
    if dist.is_initialized():
        dist.destroy_process_group()


def _shapes_of(theirs: list[list[Any]], ours: list[list[Any]], names: list[str]) -> str:
    """How the parameters ``names`` differ: this rank's shape against rank 0's."""
    mine = {n: s for n, s, _ in theirs}
    zero = {n: s for n, s, _ in ours}
    return ", ".join(f"{n}: {mine.get(n, 'absent')} vs rank 0's {zero.get(n, 'absent')}"
                     for n in sorted(set(names))[:4])


def check_same_everywhere(model: nn.Module, config: Config, worker: WorkerInfo,
                           group: dist.ProcessGroup) -> None:
    """Every worker must run the same model with the same Config: compared with rank 0's at
    start-up, before anything is exchanged (collective)."""
    mine = {"config": config.to_dict(),
            "parameters": [[n, list(p.shape), str(p.dtype)] for n, p in model.named_parameters()],
            "partition_groups": {n: [g.name, g.max_partitions] for n, p in model.named_parameters()
                                 if (g := group_of(p)) is not None}}
    everyone: list[Any] = [None] * worker.world_size
    dist.all_gather_object(everyone, mine, group=group)
    reference = everyone[0]
    problems = []
    for rank, theirs in enumerate(everyone[1:], start=1):
        fields = sorted(k for k in reference["config"]
                        if theirs["config"].get(k) != reference["config"][k])
        if fields:
            problems.append(f"rank {rank}'s Config differs in " + ", ".join(
                f"{k} ({theirs['config'].get(k)!r} vs {reference['config'][k]!r})"
                for k in fields))
        if theirs["parameters"] != reference["parameters"]:
            ours = {n: (s, d) for n, s, d in reference["parameters"]}
            odd = [n for n, s, d in theirs["parameters"] if ours.get(n) != (s, d)]
            odd += [n for n in ours if n not in {t[0] for t in theirs["parameters"]}]
            problems.append(f"rank {rank}'s model differs in parameter(s) {sorted(set(odd))}"
                            f" ({_shapes_of(theirs['parameters'], reference['parameters'], odd)})")
        if theirs["partition_groups"] != reference["partition_groups"]:
            problems.append(f"rank {rank}'s parallax.partitioner groups differ "
                            f"({theirs['partition_groups']} vs {reference['partition_groups']})")
    if problems:
        raise UnsupportedProgramError(
            f"rank {worker.rank}: workers disagree with rank 0: " + "; ".join(problems)
            + ". Every worker must build the same model and Config: the single-device "
            "program's. A program that builds its model from its rank or the world size "
            "(a model-parallel mode switched on by WORLD_SIZE, as DLRM's dlrm_s_pytorch.py "
            "does; each rank its own slice of a table) builds a different one on each rank: "
            "build the whole single-device model on every rank (for DLRM its one-process "
            "path) and let parallax shard the tables.")
