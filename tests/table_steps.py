"""One step through a table and its single-device reference: shared by the unit tests of the
two table kinds (tests/unit/test_server_table.py, test_replicated_table.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from parallax.engine.tables.table import Table


def lookup_step(table: Table, lookups: list[tuple[Tensor, Tensor]]) -> list[Tensor]:
    """One forward (a lookup per (ids, coefficient)), backward and push; the looked-up values."""
    values = []
    loss = torch.zeros((), dtype=torch.float64)
    for ids, coefficient in lookups:
        rows, inverse = table.lookup(ids)
        values.append(rows[inverse])
        loss = loss + (rows[inverse] * coefficient).sum()
    loss.backward()
    table.push_gradients()
    return values


def reference_grad(weight: Tensor, lookups: list[tuple[Tensor, Tensor]], **options) -> Tensor:
    """The single-device gradient of the same loss through F.embedding."""
    reference = weight.detach().clone().requires_grad_(True)
    sum((F.embedding(ids, reference, **options) * c).sum() for ids, c in lookups).backward()
    return reference.grad
