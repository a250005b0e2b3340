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

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from parallax.engine.optimizers.row_update import RowStep, has_row_update, update_rows
from parallax.engine.optimizers.shard_optimizer import optimizer_class, zero_gradient_is_identity
from parallax.engine.tables.replicated import ReplicatedTable

__all__ = ["param_group_of", "touched_rows_only"]


class touched_rows_only:  # noqa: N801 (used as a context manager, as contextlib's are)
    """On entry, every eligible table of ``tables`` (replicated) has its touched rows
    stepped and its gradient hidden from ``optimizers`` while inside (put back on the way out),
    so that their ``step()`` leaves it alone. (A class, not a generator context: it runs
    every step, and a generator context costs several Python calls more.)"""

    def __init__(self, tables: Sequence[ReplicatedTable],
                 optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.tables = tables
        self.optimizers = optimizers
        self.swapped: list[tuple[nn.Parameter, torch.Tensor]] = []

    def __enter__(self) -> None:
        try:
            batched: dict[int, tuple[type[torch.optim.Optimizer], dict[str, Any],
                                     list[RowStep]]] = {}
            for table in self.tables:
                self._take_touched_rows(table, batched)
            for cls, group, steps in batched.values():  # a param group's tables at once
                update_rows(cls, group, steps)
        except BaseException:
            self._put_back()
            raise

    def __exit__(self, *exc_info: object) -> None:
        self._put_back()

    def _take_touched_rows(self, table: ReplicatedTable,
                           batched: dict[int, tuple[type[torch.optim.Optimizer],
                                                    dict[str, Any], list[RowStep]]]) -> None:
        """Add ``table``'s touched rows to its param group's update in ``batched`` and hide
        its gradient, where it is eligible."""
        param, grad, rows = table.param, table.param.grad, table.touched_rows()
        if grad is None or grad.is_sparse or rows is None or rows.numel() == table.num_rows:
            return
        owner = param_group_of(param, self.optimizers)
        if owner is None or not zero_gradient_is_identity(*owner):
            return
        cls = optimizer_class(owner[0])
        if not has_row_update(cls, param):
            return
        if id(owner[1]) not in batched:
            batched[id(owner[1])] = (cls, owner[1], [])
        batched[id(owner[1])][2].append(RowStep(param, grad, rows, owner[0].state[param]))
        param.grad = None
        self.swapped.append((param, grad))

    def _put_back(self) -> None:
        for param, grad in self.swapped:
            param.grad = grad
        self.swapped.clear()


def param_group_of(param: nn.Parameter, optimizers: Sequence[torch.optim.Optimizer],
                   ) -> tuple[torch.optim.Optimizer, dict[str, Any]] | None:
    """The optimizer and param group that update ``param`` (None: none of them)."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            if any(p is param for p in group["params"]):
                return optimizer, group
    return None
