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


def _sum_allreduce_hook(group: dist.ProcessGroup, bucket: dist.GradBucket,
                        ) -> torch.futures.Future[torch.Tensor]:
    """AllReduce without DDP's division by the world size (``Config(average_dense=False)``)."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def wrap_dense(module: nn.Module, *, device: torch.device, average: bool,
               find_unused_parameters: bool) -> nn.Module:
    """``module`` under DDP, or as is when it has no trainable (dense) parameter."""
    if not any(p.requires_grad for p in module.parameters()):
        return module
    ddp = DistributedDataParallel(
        module,
        device_ids=[device.index] if device.type == "cuda" else None,
        find_unused_parameters=find_unused_parameters,
    )
    if not average:
        ddp.register_comm_hook(dist.group.WORLD, _sum_allreduce_hook)
    return ddp

