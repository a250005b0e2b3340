"""Small models shared by tests and their launched workers (``tests/scripts`` put this folder on
``sys.path`` themselves; pytest's conftest does it for the tests)."""

from __future__ import annotations

import torch
from torch import nn


class EmbeddingRegressor(nn.Module):
    """The smallest model with a sparse and a dense part: ``head(mean(embedding(ids)))``, one
    output per row of ids. ``options`` go to `nn.Embedding` (e.g. ``max_norm``)."""

    def __init__(self, rows: int = 10, dim: int = 4, **options: object) -> None:
        super().__init__()
        self.embedding = nn.Embedding(rows, dim, **options)
        self.head = nn.Linear(dim, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(ids).mean(dim=1)).squeeze(1)
