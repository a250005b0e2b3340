"""Dense parameters: replicated on every worker, synchronised as `Config.dense_sync` says:
gradients AllReduced by PyTorch DDP through a comm hook (``hierarchical``, ``flat``, ``qsgd``),
or updates through servers (``plump``, ``slim``: `server_sync.ServerSync`, no DDP).

DDP brings bucketing and overlap of the AllReduce with the backward pass. The module given to
it holds only dense parameters: the sparse ones have been replaced by lookups into the
servers' shards, which are plain attributes DDP cannot see (were a shard a parameter, DDP would
overwrite every shard with rank 0's and average unrelated gradients).

A strategy is DDP's own pattern (`torch.distributed.algorithms.ddp_comm_hooks`): a hook
``(state, bucket) -> Future[Tensor]`` in a file of its own, registered in `HOOKS` under a
`DenseSyncName`. The state (`DenseSyncState`) carries what every hook needs: where to count
bytes, the parameters' names, and whether to average. Adding one (e.g. a quantising codec) is
one file and one entry here; the hook must leave the bucket summed (or averaged) over all ranks
(the same on every rank) and count the bytes it sends in ``state.traffic`` so
``runner.stats()`` stays honest.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import GradBucket
from torch.nn.parallel import DistributedDataParallel

from parallax.config import QSGD, DenseSyncName
from parallax.engine.dense_sync.flat import flat_allreduce
from parallax.engine.dense_sync.hierarchical import hierarchical_allreduce
from parallax.engine.dense_sync.qsgd import qsgd_allgather
from parallax.engine.dense_sync.qsgd_codec import QSGDCodec
from parallax.engine.dense_sync.state import DenseSyncState
from parallax.engine.tables import reduction
from parallax.engine.tables.exchange import Traffic
from parallax.lazy import submodule_attributes

CommHook = Callable[[DenseSyncState, GradBucket], torch.futures.Future[torch.Tensor]]

#: every dense-synchronisation strategy, by the name `Config.dense_sync` gives it
HOOKS: dict[DenseSyncName, CommHook] = {
    DenseSyncName.HIERARCHICAL: hierarchical_allreduce,
    DenseSyncName.FLAT: flat_allreduce,
    DenseSyncName.QSGD: qsgd_allgather,
}

#: the hooks whose result is the exact sum of the workers' gradients: with one worker that
#: is its own gradient, so there is nothing to run (``qsgd`` quantises even one worker's; a
#: hook registered in `HOOKS` by the user runs whatever the world)
SUMS_EXACTLY: frozenset[CommHook] = frozenset({hierarchical_allreduce, flat_allreduce})

__all__ = ["HOOKS", "SUMS_EXACTLY", "CommHook", "DenseSyncState", "QSGDCodec", "codec_of",
           "wrap_dense"]


def codec_of(qsgd: QSGD | None) -> QSGDCodec | None:
    """The codec `Config.qsgd` describes."""
    return None if qsgd is None else QSGDCodec(qsgd.bits, qsgd.bucket_size)


def wrap_dense(module: nn.Module, *, device: torch.device, sync: str, average: bool,
               find_unused_parameters: bool, traffic: Traffic, qsgd: QSGD | None = None,
               seed: int = 0) -> tuple[nn.Module, DenseSyncState | None]:
    """``module`` under DDP with the ``sync`` strategy's comm hook and the hook's state, or
    ``(module, None)`` when it has no trainable (dense) parameter. ``qsgd``: the codec's
    options of ``sync="qsgd"``; its random rounding is seeded by ``seed`` and the rank."""
    if not any(p.requires_grad for p in module.parameters()):
        return module, None
    ddp = DistributedDataParallel(
        module,
        device_ids=[device.index] if device.type == "cuda" else None,
        find_unused_parameters=find_unused_parameters,
    )
    names = {id(p): n for n, p in module.named_parameters()}
    rank = dist.get_rank()
    generator = torch.Generator(device=device).manual_seed((seed * 1_000_003 + rank) % 2**63)
    payload = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    small_sums = (device.type == "cpu" and "gloo" in str(dist.get_backend())
                  and reduction.small(payload, dist.get_world_size()))
    state = DenseSyncState(traffic, names, dist.get_world_size(), average,
                           codec=codec_of(qsgd), generator=generator, small_sums=small_sums)
    ddp.register_comm_hook(state, HOOKS[DenseSyncName(sync)])
    return ddp, state

# submodules not imported above, as attributes on first use
__getattr__ = submodule_attributes(__name__)
