"""Decisions every rank must take alike.

A rank that branches on what it alone sees (a file on its disk, a cache entry, optimizer state
only a server holds, the outcome of work only rank 0 did) can take another branch than its
peers, and ranks on different branches wait in different collectives until they time out.
Where a decision must be the same everywhere, rank 0 takes it and every rank follows rank 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar, cast

import torch
import torch.distributed as dist

__all__ = ["agree", "first_difference"]

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


def first_difference(state: Mapping[str, torch.Tensor], *, rank: int, world: int,
                     group: dist.ProcessGroup | None) -> tuple[int, str] | None:
    """The first (rank, key) whose tensor in ``state`` differs from rank 0's, or None when
    every rank passed the same keys and values (collective). Compared by fingerprints (the
    sum, the sum of squares and a position-weighted sum, in float64): the tensors do not
    travel."""
    mine = {key: _fingerprint(value) for key, value in state.items()}
    everyone: list[dict[str, tuple[float, ...]] | None] = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    reference = everyone[0]
    assert reference is not None
    for other, theirs in enumerate(everyone[1:], start=1):
        assert theirs is not None
        for key in sorted(set(reference) | set(theirs)):
            if reference.get(key) != theirs.get(key):
                return other, key
    return None


_CHUNK = 1 << 20  # elements converted to float64 at a time: a table is never copied whole


def _fingerprint(value: torch.Tensor) -> tuple[float, ...]:
    if not isinstance(value, torch.Tensor):
        return (float("nan"),) if value is None else (hash(repr(value)),)
    flat = value.detach().reshape(-1)
    sums = torch.zeros(3, dtype=torch.float64, device=flat.device)
    for start in range(0, flat.numel(), _CHUNK):
        part = flat[start:start + _CHUNK].to(torch.float64)
        weights = torch.arange(start, start + part.numel(), device=part.device,
                               dtype=torch.float64) % 97 + 1
        sums += torch.stack([part.sum(), (part * part).sum(), (part * weights).sum()])
    return (*value.shape, *sums.tolist())
