"""The user surface: `shard` a data loader, `get_runner` for the model. Three changed lines."""

from __future__ import annotations

import atexit
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler

from parallax import hierarchy
from parallax.analysis import find_sparse_parameters
from parallax.architecture import server_held
from parallax.cluster import WorkerInfo, current_worker, parse_resources
from parallax.config import Config
from parallax.launch import free_port, install_error_recorder, launch
from parallax.optim import as_optimizer_list, check_lazy, check_per_shard
from parallax.runner import LossFn, Runner

log = logging.getLogger("parallax")

_sparse_group: dist.ProcessGroup | None = None


class ShardedLoader:
    """This worker's disjoint part of a ``DataLoader``.

    Worker r of W takes samples r, r+W, r+2W, ... (``DistributedSampler``), so its k-th batch
    of b samples and the other workers' k-th batches together are exactly samples
    ``[k*W*b, (k+1)*W*b)``: the single-device program's k-th batch with batch size ``W*b``.
    Each new iteration is a new epoch (new shuffle order when the original loader shuffled).
    """

    def __init__(self, loader: DataLoader, sampler: DistributedSampler, worker: WorkerInfo):
        self.loader = loader
        self.sampler = sampler
        self.worker = worker
        self.epoch = 0

    def __iter__(self) -> Iterator[Any]:
        self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)


def shard(loader: DataLoader, *, seed: int = 0) -> DataLoader | ShardedLoader:
    """This worker's part of ``loader``; the loader itself outside a parallax launch."""
    worker = current_worker()
    if worker is None:
        return loader
    if isinstance(loader.dataset, IterableDataset):
        raise TypeError("parallax.shard needs a map-style dataset (with __len__ and "
                        "__getitem__); got an IterableDataset, which cannot be split by index")
    if loader.batch_size is None:
        raise TypeError("parallax.shard needs a DataLoader built with batch_size "
                        "(a custom batch_sampler cannot be split)")
    sampler = DistributedSampler(loader.dataset, num_replicas=worker.world_size,
                                 rank=worker.rank, shuffle=isinstance(loader.sampler,
                                                                      RandomSampler),
                                 seed=seed, drop_last=loader.drop_last)
    sharded = DataLoader(
        loader.dataset, batch_size=loader.batch_size, sampler=sampler,
        num_workers=loader.num_workers, collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory, drop_last=loader.drop_last, timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        persistent_workers=loader.persistent_workers if loader.num_workers else False,
    )
    return ShardedLoader(sharded, sampler, worker)


def get_runner(model: torch.nn.Module,
               optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
               loss_fn: LossFn, *, resources: str | os.PathLike | None = None,
               config: Config | None = None) -> Runner:
    """Wrap a single-device training program for hybrid data-parallel training.

    * Inside a worker (started by ``parallax run``, by ``torchrun``, or by this function),
      joins the process group and returns the `Runner`.
    * In a plain ``python train.py`` with ``resources``: launches one worker per resource slot
      running this same script, waits for them, and exits with their status (as the papers'
      Parallax does); nothing after this call runs in the launching process.
    * In a plain ``python train.py`` without ``resources``: a one-worker run in this process.
    """
    config = config if config is not None else Config()
    if not isinstance(config, Config):
        raise TypeError(f"config must be a parallax.Config, got {type(config).__name__}")
    optimizers = as_optimizer_list(optimizer)
    worker = current_worker()
    if worker is None and resources is not None:
        _check_before_launch(model, optimizers, config)
        spec = parse_resources(resources)
        sys.exit(launch(spec, [sys.argv[0], *sys.argv[1:]]))
    if worker is None:
        worker = _single_process_worker()
    install_error_recorder()
    torch.manual_seed(config.seed)
    group = _join(worker, config)
    return Runner(model, optimizers, loss_fn, worker=worker, config=config, sparse_group=group)


def _check_before_launch(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
                         config: Config) -> None:
    """Fail in the launching process, before any worker starts, on what workers would reject."""
    sparse = find_sparse_parameters(model)
    check_per_shard(optimizers, server_held(model, sparse, config))
    if config.lazy_sparse_updates:
        params = dict(model.named_parameters())
        check_lazy(optimizers, {name: params[name] for name in sparse})


def _single_process_worker() -> WorkerInfo:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      GROUP_RANK="0")
    worker = current_worker()
    assert worker is not None
    return worker


def _join(worker: WorkerInfo, config: Config) -> dist.ProcessGroup:
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
    hierarchy.leave()
    if _sparse_group is not None and dist.is_initialized():
        dist.destroy_process_group(_sparse_group)
    _sparse_group = None
    if dist.is_initialized():
        dist.destroy_process_group()
