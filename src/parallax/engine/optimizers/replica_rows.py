"""Replicated tables updated at their touched rows only, where that is exact.

Under ``architecture="allreduce"`` (the Horovod way), and for one worker's replicas, every
worker holds a whole table and the user's optimizer updates it from the gradient all workers'
rows were summed into. Where a zero gradient leaves a row and its optimizer state exactly as
they are (`parallax.engine.optimizers.shard_optimizer.zero_gradient_is_identity`: plain SGD,
Adagrad without weight decay), only the rows any worker touched are stepped, by the optimizer's
own functional step on those rows (`parallax.engine.optimizers.row_update`), and the table
takes no part in the optimizer's ``step()``: the work the servers do for the same table, and
what Horovod's TensorFlow optimizers do with the ``IndexedSlices`` of an embedding's gradient.
Every other row would have been left unchanged by the dense update, so the result is the
dense program's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from parallax.engine.optimizers.row_update import has_row_update, update_rows
from parallax.engine.optimizers.shard_optimizer import optimizer_class, zero_gradient_is_identity
from parallax.engine.tables.replicated import ReplicatedTable

__all__ = ["param_group_of", "touched_rows_only"]


@contextmanager
def touched_rows_only(tables: Iterable[object],
                      optimizers: Sequence[torch.optim.Optimizer]) -> Iterator[None]:
    """On entry, every eligible replicated table among ``tables`` has its touched rows
    stepped and its gradient hidden from ``optimizers`` while inside (put back on the way out),
    so that their ``step()`` leaves it alone."""
    swapped: list[tuple[nn.Parameter, torch.Tensor]] = []
    try:
        for table in tables:
            if not isinstance(table, ReplicatedTable):
                continue
            param, grad, rows = table.param, table.param.grad, table.touched_rows()
            if grad is None or grad.is_sparse or rows is None or rows.numel() == table.num_rows:
                continue
            owner = param_group_of(param, optimizers)
            if owner is None or not zero_gradient_is_identity(*owner):
                continue
            cls = optimizer_class(owner[0])
            if not has_row_update(cls, param):
                continue
            update_rows(cls, owner[1], owner[0].state[param], param, grad, rows)
            param.grad = None
            swapped.append((param, grad))
        yield
    finally:
        for param, grad in swapped:
            param.grad = grad


def param_group_of(param: nn.Parameter, optimizers: Sequence[torch.optim.Optimizer],
                   ) -> tuple[torch.optim.Optimizer, dict[str, Any]] | None:
    """The optimizer and param group that update ``param`` (None: none of them)."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            if any(p is param for p in group["params"]):
                return optimizer, group
    return None
