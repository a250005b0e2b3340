"""Decisions every rank must take alike.

A rank that branches on what it alone sees (a file on its disk, a cache entry, optimizer state
only a server holds, the outcome of work only rank 0 did) can take another branch than its
peers, and ranks on different branches wait in different collectives until they time out.
Where a decision must be the same everywhere, rank 0 takes it and every rank follows rank 0.
"""

from __future__ import annotations

from typing import TypeVar, cast

import torch.distributed as dist

__all__ = ["agree"]

T = TypeVar("T")


def agree(value_on_rank0: T | None, *, rank: int, group: dist.ProcessGroup | None) -> T:
    """Rank 0's ``value_on_rank0``, returned on every rank of ``group`` (collective: every rank
    of ``group`` calls it, rank 0 among them).

    ``rank`` is this process's global rank; the other ranks' values are ignored (they may pass
    None, or the value they computed themselves). The value must pickle
    (``dist.broadcast_object_list``).
    """
    box = [value_on_rank0 if rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=group)
    return cast(T, box[0])
