"""Dense parameters: replicated on every worker, gradients AllReduced by PyTorch DDP.

DDP brings bucketing and overlap of the AllReduce with the backward pass. The module given to
it holds only dense parameters: the sparse ones have been replaced by lookups into the
servers' shards, which are plain attributes DDP cannot see (were a shard a parameter, DDP would
overwrite every shard with rank 0's and average unrelated gradients).
"""


import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from parallax.engine import hierarchy
from parallax.engine.exchange import Traffic


class _DenseTraffic:
    """State of the comm hook: where to account bytes, and whether to average."""

    def __init__(self, traffic: Traffic, names: dict[int, str], world: int, average: bool):
        self.traffic = traffic
        self.names = names
        self.world = world
        self.average = average


def _counting_allreduce(state: _DenseTraffic, bucket: dist.GradBucket,
                        ) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: AllReduce the bucket (mean or sum), machine by machine
    (`parallax.engine.hierarchy`), and account its bytes per parameter, so ``runner.stats()`` covers
    the dense part too. The three collectives run before the hook returns: the backward waits
    for them (on CPU there is little compute to overlap with)."""
    buffer = bucket.buffer()
    offset = 0
    for param in bucket.parameters():  # bytes per parameter: slices of the bucket
        name = state.names.get(id(param), "dense")
        piece = buffer.narrow(0, offset, param.numel())
        offset += param.numel()
        hierarchy.account(piece, traffic=state.traffic, name=name)
    hierarchy.all_reduce(buffer)
    if state.average:
        buffer.div_(state.world)
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(buffer)
    return done


def wrap_dense(module: nn.Module, *, device: torch.device, average: bool,
               find_unused_parameters: bool, traffic: Traffic) -> nn.Module:
    """``module`` under DDP, or as is when it has no trainable (dense) parameter."""
    if not any(p.requires_grad for p in module.parameters()):
        return module
    ddp = DistributedDataParallel(
        module,
        device_ids=[device.index] if device.type == "cuda" else None,
        find_unused_parameters=find_unused_parameters,
    )
    names = {id(p): n for n, p in module.named_parameters()}
    ddp.register_comm_hook(_DenseTraffic(traffic, names, dist.get_world_size(), average),
                           _counting_allreduce)
    return ddp
