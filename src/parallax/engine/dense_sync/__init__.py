"""Dense parameters: replicated on every worker, gradients AllReduced by PyTorch DDP through a
comm hook chosen by `Config.dense_sync`.

DDP brings bucketing and overlap of the AllReduce with the backward pass. The module given to
it holds only dense parameters: the sparse ones have been replaced by lookups into the
servers' shards, which are plain attributes DDP cannot see (were a shard a parameter, DDP would
overwrite every shard with rank 0's and average unrelated gradients).

A strategy is DDP's own pattern (`torch.distributed.algorithms.ddp_comm_hooks`): a hook
``(state, bucket) -> Future[Tensor]`` in a file of its own, registered in `HOOKS` under a
`DenseSyncName`. The state (`DenseSyncState`) carries what every hook needs: where to count
bytes, the parameters' names, and whether to average. Adding one (e.g. a quantising codec) is
one file and one entry here; the hook must leave the bucket summed (or averaged) over all ranks
and count the bytes it sends in ``state.traffic`` so ``runner.stats()`` stays honest.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from parallax.config import DenseSyncName
from parallax.engine.dense_sync.flat import flat_allreduce
from parallax.engine.dense_sync.hierarchical import hierarchical_allreduce
from parallax.engine.dense_sync.state import DenseSyncState
from parallax.engine.exchange import Traffic

CommHook = Callable[[DenseSyncState, dist.GradBucket], torch.futures.Future[torch.Tensor]]

#: every dense-synchronisation strategy, by the name `Config.dense_sync` gives it
HOOKS: dict[DenseSyncName, CommHook] = {
    DenseSyncName.HIERARCHICAL: hierarchical_allreduce,
    DenseSyncName.FLAT: flat_allreduce,
}

__all__ = ["HOOKS", "CommHook", "DenseSyncState", "wrap_dense"]


def wrap_dense(module: nn.Module, *, device: torch.device, sync: str, average: bool,
               find_unused_parameters: bool, traffic: Traffic) -> nn.Module:
    """``module`` under DDP with the ``sync`` strategy's comm hook, or as is when it has no
    trainable (dense) parameter."""
    if not any(p.requires_grad for p in module.parameters()):
        return module
    ddp = DistributedDataParallel(
        module,
        device_ids=[device.index] if device.type == "cuda" else None,
        find_unused_parameters=find_unused_parameters,
    )
    names = {id(p): n for n, p in module.named_parameters()}
    state = DenseSyncState(traffic, names, dist.get_world_size(), average)
    ddp.register_comm_hook(state, HOOKS[DenseSyncName(sync)])
    return ddp

