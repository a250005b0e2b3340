"""A mean over the global batch when the count of what is averaged differs between workers.

``F.cross_entropy(..., ignore_index=PAD)`` divides a worker's summed loss by the tokens *it*
did not ignore; class weights divide by the weights of its own targets; a masked mean by its
own mask. With W workers the gradients are then averaged over workers (as under DDP), which is
the single-device mean only when every worker counted the same. The exact form needs the global
count: worker w's loss ``W * S_w / N`` (``N`` summed over workers) averages to ``S / N``, one
device's (and ``S_w / N`` when `Config` sums rather than averages). The value returned is
``S / N`` itself on every rank, so a logged loss is one device's; the gradient is the share's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from parallax.cluster import WorkerInfo
from parallax.config import Config
from parallax.errors import ArgumentError, ArgumentTypeError, UnsupportedProgramError
from parallax.step.loop_order import Call, LoopOrder

__all__ = ["global_mean", "plain_mean"]


def plain_mean(total: Tensor, count: Tensor | float) -> Tensor:
    """``total / count`` after the same checks: what one device computes."""
    count = _checked(total, count)
    return total / count.to(total.dtype)


def global_mean(total: Tensor, count: Tensor | float, *, worker: WorkerInfo, config: Config,
                order: LoopOrder, step: int, aligned: bool) -> Tensor:
    """``total`` (this worker's sum, with autograd) over the count summed over every worker
    of the run; see the module docstring. ``step``: the step it belongs to; ``aligned``:
    whether the workers step together. Collective when they do (one small all_gather that
    ``order`` also checks that every rank made this call by)."""
    count = _checked(total, count)
    if worker.world_size == 1 or not aligned:
        # one worker; or asynchronous workers, whose gradients apply one by one: each its own
        return total / count.to(total.dtype)
    if config.parallelism != "data":
        raise UnsupportedProgramError(
            f"rank {worker.rank}: parallax.global_mean counts over data-parallel workers; under "
            f"Config.parallelism={config.parallelism!r} model groups share samples, so their "
            "counts would be added twice: average over the batch's count in the program")
    if config.average_dense != config.average_sparse:
        raise UnsupportedProgramError(
            f"rank {worker.rank}: parallax.global_mean needs one gradient scale for every "
            f"parameter, but Config.average_dense={config.average_dense} and average_sparse="
            f"{config.average_sparse}: set both alike")
    mine = torch.stack([count.reshape(()), total.detach().reshape(()).to(torch.float64)])
    sums = order.gather(Call.MEAN, step, mine).sum(dim=0)
    global_count, global_total = sums[0], sums[1]
    workers = worker.world_size if config.average_dense else 1
    share: Tensor = total * (workers / global_count).to(total.dtype)
    return share + (global_total / global_count - share.detach()).to(total.dtype)


def _checked(total: Tensor, count: Tensor | float) -> Tensor:
    """``count`` as a float64 scalar on ``total``'s device, detached; both checked."""
    if not isinstance(total, Tensor):
        raise ArgumentTypeError(f"parallax.global_mean: total must be a tensor (a summed loss, "
                                f"e.g. reduction='sum'), got {type(total).__name__}")
    if total.numel() != 1:
        raise ArgumentError(f"parallax.global_mean: total must hold one value (a summed loss), "
                            f"got shape {tuple(total.shape)}")
    if isinstance(count, bool) or not isinstance(count, (Tensor, int, float)):
        raise ArgumentTypeError(f"parallax.global_mean: count must be a number or a tensor, "
                                f"got {type(count).__name__}")
    value = torch.as_tensor(count).detach()
    if value.numel() != 1:
        raise ArgumentError(f"parallax.global_mean: count must hold one value, got shape "
                            f"{tuple(value.shape)}")
    return value.to(device=total.device, dtype=torch.float64).reshape(())
