"""The step's collectives issued on the process group object itself.

``torch.distributed.all_to_all_single`` and ``all_gather_single`` are thin Python layers over
the process group's own methods: torch-function dispatch, an exception logger, tensor checks,
the coalescing context, the default group's lookup. Together they cost about 15 to 25 Python
calls a collective, and a step of the sparse engine issues four to six of them (record
host-counts-2w-distribute; a GPU step waits for the host that issues them). The engine's
tensors are made by the engine (dense, of one dtype, on the group's device, never in a
coalescing context), so the methods are called directly here; what the layers do that still
applies is done here too (complex tensors travel as real views; the wait is the process
group's, under its timeout).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, AllToAllOptions

from parallax.errors import InternalError

__all__ = ["all_gather_single", "all_to_all_single", "size"]


def _group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    if group is not None:
        return group
    world = dist.group.WORLD
    if not isinstance(world, dist.ProcessGroup):
        raise InternalError("parallax internal error: a collective without a process group "
                            "(torch.distributed is not initialised); please report it")
    return world


def size(group: dist.ProcessGroup | None) -> int:
    """``dist.get_world_size(group)``: the group's own count (one call, where c10d's layers
    take several, and the exchange asks at every message)."""
    return int(_group(group).size())


def _real(tensor: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


def all_to_all_single(out: torch.Tensor, message: torch.Tensor,
                      recv_splits: Sequence[int] | None, send_splits: Sequence[int] | None, *,
                      group: dist.ProcessGroup | None, async_op: bool) -> dist.Work | None:
    """``dist.all_to_all_single(out, message, recv_splits, send_splits, group=group,
    async_op=async_op)``; None when it has waited."""
    opts = AllToAllOptions()
    opts.asyncOp = async_op
    if out.is_complex() or message.is_complex():
        out, message = _real(out), _real(message)
    work = _group(group).all_to_all_single(out, message,
                                           list(recv_splits) if recv_splits else [],
                                           list(send_splits) if send_splits else [], opts)
    if async_op:
        return work
    work.wait()
    return None


def all_gather_single(out: torch.Tensor, tensor: torch.Tensor, *,
                      group: dist.ProcessGroup | None) -> None:
    """``dist.all_gather_single(out, tensor, group=group)``: every rank's ``tensor``, in rank
    order, in ``out``."""
    opts = AllgatherOptions()
    opts.asyncOp = False
    if out.is_complex() or tensor.is_complex():
        out, tensor = _real(out), _real(tensor)
    _group(group).all_gather_single(out, tensor, opts).wait()
