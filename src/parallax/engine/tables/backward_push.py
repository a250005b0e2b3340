"""Replicated tables' gradients summed at the end of each backward of the own loop.

Under `parallax.distribute` the program's own code runs between ``loss.backward()`` and
``optimizer.step()``, and may read or change every parameter's ``.grad`` there (a hand-written
gradient scaling, weight decay or noise, a logged norm). DDP's dense gradients are already the
workers' average at that point; a replicated table's (``architecture="allreduce"``, or a table
the hybrid moved to AllReduce) would only be summed at the step, so its ``.grad`` read None and
such code silently skipped it. Here every lookup row of a replicated table carries a hook that
queues one callback at the end of the backward that reaches it (autograd's queued callback, as
DDP's reducer does), and the callback pushes every replicated table's rows, in name order on
every rank (and a table read whole, `parallax.engine.tables.own_summed`, from the first
gradient its weight catches). The rows stay pending with their gradient cleared, so a second
backward through a retained graph is pushed at its own end; the step then pushes nothing more
(`ReplicatedTable.push_after_backward`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from parallax.engine.tables.own_summed import SummedOwnTable
from parallax.engine.tables.replicated import ReplicatedTable

__all__ = ["BackwardPush"]

_HOOKED = "_parallax_backward_push"  # marks a lookup's rows already hooked


class BackwardPush:
    """`arm` after each own-loop forward; the pushes then follow each backward."""

    def __init__(self, replicas: Callable[[], list[ReplicatedTable]],
                 summed_own: Callable[[], list[SummedOwnTable]]) -> None:
        self.replicas = replicas  # the layout's, in name order (the warm-up may move some)
        self.summed_own = summed_own  # the tables read whole, their gradients summed
        self._queued = False

    def arm(self) -> None:
        """Hook the rows the replicated tables' lookups of this forward returned."""
        self._queued = False  # a backward that failed never ran its callback
        for table in self.replicas():
            table.reuse_cleared_grad = False  # the program sees .grad: no buffer kept
            for rows in table.pending_rows():
                if not getattr(rows, _HOOKED, False):
                    rows.register_hook(self._reached)
                    setattr(rows, _HOOKED, True)
        for own in self.summed_own():
            own.on_catch = self._caught

    def _reached(self, grad: Tensor) -> None:
        self._caught()

    def _caught(self) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._push)

    def _push(self) -> None:
        self._queued = False
        for table in self.replicas():
            table.push_after_backward()
        owns = self.summed_own()
        if owns:
            SummedOwnTable.push_after_backward(owns)
