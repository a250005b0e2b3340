"""Stand-ins for the layers that read a sparse parameter: they pull rows from the servers.

Each holds a `ShardedTable` (a plain attribute, not a parameter or buffer: DDP must never see
it) and computes exactly what the original layer computes, on the pulled unique rows.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from parallax.engine.server_table import ShardedTable


def _padding_row(table: ShardedTable, ids: Tensor, inverse: Tensor,
                 padding_idx: int | None) -> int | None:
    """The original ``padding_idx`` as an index into the pulled unique rows (None if absent),
    so the padding row keeps a zero gradient exactly as in the original layer."""
    if padding_idx is None:
        return None
    if padding_idx < 0:
        padding_idx += table.num_rows
    hits = (ids.reshape(-1) == padding_idx).nonzero()
    return int(inverse.reshape(-1)[hits[0, 0]]) if hits.numel() else None


class ShardedEmbedding(nn.Module):
    """Replaces ``nn.Embedding``: same output, rows come from the parameter servers."""

    def __init__(self, table: ShardedTable, padding_idx: int | None = None):
        super().__init__()
        self.table = table
        self.padding_idx = padding_idx

    def forward(self, ids: Tensor) -> Tensor:
        rows, inverse = self.table.lookup(ids)
        padding = _padding_row(self.table, ids, inverse, self.padding_idx)
        return F.embedding(inverse, rows, padding_idx=padding)

    def extra_repr(self) -> str:
        return f"'{self.table.name}', rows={self.table.num_rows}, padding_idx={self.padding_idx}"


class ShardedEmbeddingBag(nn.Module):
    """Replaces ``nn.EmbeddingBag`` (sum / mean / max bags, offsets, per-sample weights)."""

    def __init__(self, table: ShardedTable, *, mode: str, padding_idx: int | None,
                 include_last_offset: bool):
        super().__init__()
        self.table = table
        self.mode = mode
        self.padding_idx = padding_idx
        self.include_last_offset = include_last_offset

    def forward(self, ids: Tensor, offsets: Tensor | None = None,
                per_sample_weights: Tensor | None = None) -> Tensor:
        rows, inverse = self.table.lookup(ids)
        padding = _padding_row(self.table, ids, inverse, self.padding_idx)
        return F.embedding_bag(inverse, rows, offsets, mode=self.mode,
                               per_sample_weights=per_sample_weights,
                               include_last_offset=self.include_last_offset,
                               padding_idx=padding)

    def extra_repr(self) -> str:
        return f"'{self.table.name}', rows={self.table.num_rows}, mode={self.mode}"


class ShardedGather(nn.Module):
    """Replaces a row gather on a plain parameter found by tracing (``F.embedding(ids, w)``,
    ``w[ids]``, ``w.index_select(0, ids)``): returns the gathered rows."""

    def __init__(self, table: ShardedTable):
        super().__init__()
        self.table = table

    def forward(self, ids: Tensor, padding_idx: int | None = None) -> Tensor:
        rows, inverse = self.table.lookup(ids)
        padding = _padding_row(self.table, ids, inverse, padding_idx)
        return F.embedding(inverse, rows, padding_idx=padding)
