"""Replicated tables updated at their touched rows only, where that is exact.

Under ``architecture="allreduce"`` (the Horovod way) every worker holds a whole table and the
user's optimizer updates it from the gradient all workers' rows were summed into. Where a zero
gradient leaves a row and its optimizer state exactly as they are
(`parallax.engine.optimizers.shard_optimizer.zero_gradient_is_identity`: plain SGD, Adagrad
without weight decay), the optimizer is handed a sparse gradient of the rows any worker touched
instead, so that it updates those rows alone: the work the servers do for the same table, and
what Horovod's TensorFlow optimizers do with the ``IndexedSlices`` of an embedding's gradient.
Every other row would have been left unchanged by the dense update, so the result is the
dense program's (to rounding: torch's sparse Adagrad divides before it scales).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from parallax.engine.optimizers.shard_optimizer import zero_gradient_is_identity
from parallax.engine.tables.replicated import ReplicatedTable

__all__ = ["touched_rows_only"]


@contextmanager
def touched_rows_only(tables: Iterable[object],
                      optimizers: Sequence[torch.optim.Optimizer]) -> Iterator[None]:
    """While inside, every eligible replicated table among ``tables`` holds a sparse gradient of
    its touched rows in place of its dense one (put back on the way out)."""
    swapped: list[tuple[nn.Parameter, torch.Tensor]] = []
    try:
        for table in tables:
            if not isinstance(table, ReplicatedTable):
                continue
            grad, rows = table.param.grad, table.touched_rows()
            if grad is None or grad.is_sparse or rows is None or rows.numel() == table.num_rows:
                continue
            owner = _owner(table.param, optimizers)
            if owner is None or not zero_gradient_is_identity(*owner):
                continue
            table.param.grad = torch.sparse_coo_tensor(rows.unsqueeze(0), grad[rows],
                                                       grad.shape, is_coalesced=True)
            swapped.append((table.param, grad))
        yield
    finally:
        for param, grad in swapped:
            param.grad = grad


def _owner(param: nn.Parameter, optimizers: Sequence[torch.optim.Optimizer],
           ) -> tuple[torch.optim.Optimizer, dict[str, Any]] | None:
    """The optimizer and param group that update ``param`` (None: none of them)."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            if any(p is param for p in group["params"]):
                return optimizer, group
    return None
