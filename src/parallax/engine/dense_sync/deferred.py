"""Small dense gradients summed in the push, not in a collective of their own (`Runner.step`).

When all dense gradients together are small, `hierarchical` sums them by one all_to_all
(`parallax.engine.tables.reduction`): each rank sends its buffer to every rank and adds the
copies in rank order. The step's push is an all_to_all to every rank anyway, after the
backward; so under `Runner.step`, which runs the backward and the push itself with nothing
of the user's in between, the dense gradients ride in the push's first message
(`parallax.engine.tables.riders`) and the comm hook leaves each bucket as it is. Each rank
adds the same copies in the same order and divides alike: the gradients are the bits the
all_to_all sum gives, one collective fewer per step.

Not where the user's code may read the gradients between the backward and the push (their
own loop: they would see this worker's gradients, not the sum), nor for large dense parts
(summed machine by machine), mixed dtypes, ``find_unused_parameters`` (DDP's own bitmap
exchange), a quantising hook, or asynchronous training (no push message to ride).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from parallax.engine.tables.exchange import Traffic
from parallax.engine.tables.riders import rank_order_sum

__all__ = ["DENSE_KEY", "DenseRider", "can_defer"]

#: the rider's name in the push's message (not a parameter name)
DENSE_KEY = "(dense)"


def can_defer(params: Sequence[nn.Parameter], *, small_sums: bool,
              find_unused_parameters: bool) -> bool:
    """Whether these dense parameters' sums may ride in the push (see the module)."""
    return (small_sums and not find_unused_parameters and bool(params)
            and len({p.dtype for p in params}) == 1)


class DenseRider:
    """This rank's dense gradients (``params`` in a fixed order, the same on every rank) for
    every peer; `receive` writes the sum (averaged when ``average``) back into each
    ``.grad``."""

    key = DENSE_KEY

    def __init__(self, params: Sequence[nn.Parameter], names: dict[int, str], *, world: int,
                 average: bool, traffic: Traffic) -> None:
        self.params = list(params)
        self.world = world
        self.average = average
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        for param, grad in zip(self.params, grads, strict=True):  # (its bytes by parameter)
            traffic.record_to_every_peer(names.get(id(param), "dense"),
                                         grad.numel() * grad.element_size())
        flat = torch.cat([grad.detach().reshape(-1) for grad in grads]).reshape(1, -1)
        self.waiting: Tensor | None = flat.expand(world, -1).contiguous()

    def receive(self, received: Tensor) -> None:
        """Every rank's gradients: the sum in rank order, as `reduction.all_reduce` adds."""
        total = rank_order_sum(received)
        if self.average:
            total.div_(self.world)
        pieces = total.split_with_sizes([param.numel() for param in self.params])
        have, into = [], []
        for param, piece in zip(self.params, pieces, strict=True):
            if param.grad is None:
                param.grad = piece.view_as(param).clone()
            else:
                have.append(param.grad)
                into.append(piece.view_as(param))
        if have:  # one operator for every gradient, not one copy each
            torch._foreach_copy_(have, into)
