"""This process's part in a run: joining the process groups, and leaving them cleanly.

The PS exchange gets its own group (apart from DDP's bucketed AllReduce); `shutdown` destroys
it before the default group (the order measured free of gloo aborts at exit), records that this
rank's training ended (`parallax.engine.progress`), and restores the environment a one-worker
run changed.
"""

from __future__ import annotations

import atexit
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from parallax.cluster import WorkerInfo, current_worker
from parallax.config import Config
from parallax.engine import hierarchy, progress
from parallax.engine.pool import close_shared_pools
from parallax.launch.elastic import free_port

__all__ = ["join", "shutdown", "single_process_worker"]

_sparse_group: dist.ProcessGroup | None = None


# Environment variables a one-worker run set, with their earlier values: `shutdown` puts them
# back, or a later launch from this process (a notebook, a test) would inherit RANK=0 and
# WORLD_SIZE=1 and its workers would each believe they are alone.
_saved_environment: dict[str, str | None] = {}


def single_process_worker() -> WorkerInfo:
    values = {"MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1"),
              "MASTER_PORT": os.environ.get("MASTER_PORT") or str(free_port()),
              "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
              "GROUP_RANK": "0"}
    for name, value in values.items():
        _saved_environment.setdefault(name, os.environ.get(name))
        os.environ[name] = value
    worker = current_worker()
    assert worker is not None
    return worker


def _restore_environment() -> None:
    for name, value in _saved_environment.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    _saved_environment.clear()


def join(worker: WorkerInfo, config: Config) -> dist.ProcessGroup:
    """Join the default group (if the program has not) and the group for the PS exchange."""
    global _sparse_group
    timeout = timedelta(seconds=config.collective_timeout_s)
    if not dist.is_initialized():
        backend = "nccl" if worker.device.type == "cuda" else "gloo"
        if worker.device.type == "cuda":
            torch.cuda.set_device(worker.device)
        dist.init_process_group(backend, timeout=timeout)
    if _sparse_group is None:
        # Its own group keeps the PS exchange apart from DDP's bucketed AllReduce.
        backend = "nccl" if worker.device.type == "cuda" else "gloo"
        _sparse_group = dist.new_group(backend=backend, timeout=timeout)
        hierarchy.join(worker, backend=backend, timeout=timeout)
        atexit.register(shutdown)
    return _sparse_group


def shutdown() -> None:
    """Destroy parallax's process groups: the PS group first, then the default group (the order
    that measured free of gloo aborts at exit). Safe to call twice."""
    global _sparse_group
    progress.finish_all()  # other ranks still stepping now fail at once, naming this one
    _restore_environment()
    close_shared_pools()
    hierarchy.leave()
    if _sparse_group is not None and dist.is_initialized():
        dist.destroy_process_group(_sparse_group)
    _sparse_group = None
    if dist.is_initialized():
        dist.destroy_process_group()
