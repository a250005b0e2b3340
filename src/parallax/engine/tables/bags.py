"""The bags of one ``nn.EmbeddingBag`` call, as the pooled shardings split and join them
(`parallax.engine.tables.sharding`, `parallax.engine.tables.pooled`): which bag each id is in,
each bag's size, and one owner's share of a call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from parallax.engine.tables.partitioning import RowPartitioning

__all__ = ["BagShare", "BagTable", "Bags", "bag_of_ids", "bag_sizes"]


class BagTable(Protocol):
    """What splitting a call's bags needs of its table."""

    num_rows: int
    partitioning: RowPartitioning


class Bags(Protocol):
    """One call's bags (`parallax.engine.tables.pooled.BagCall` is one)."""

    ids: Tensor
    weights: Tensor | None
    mode: str
    padding_idx: int | None

    @property
    def table(self) -> BagTable: ...

    @property
    def bags(self) -> int: ...

    @property
    def starts(self) -> Tensor: ...


@dataclass
class BagShare:
    """What one owner pools of a call: its ids in bag order, where each of the call's bags
    starts among them, and their weights."""

    starts: Tensor
    ids: Tensor
    weights: Tensor | None


def bag_of_ids(starts: Tensor, ids: int) -> Tensor:
    """Each of ``ids`` ids' bag, for bags starting at ``starts`` (the last runs to the end)."""
    lengths = torch.diff(starts, append=starts.new_tensor([ids]))
    return torch.repeat_interleave(torch.arange(starts.numel(), device=starts.device), lengths)


def bag_sizes(bag: Tensor, kept: Tensor | None, bags: int) -> Tensor:
    """Each bag's count of ids other than the padding (``kept``: None, all), at least 1: what
    ``mean`` divides by (an empty bag pools to zero)."""
    return torch.bincount(bag if kept is None else bag[kept], minlength=bags).clamp(min=1)
