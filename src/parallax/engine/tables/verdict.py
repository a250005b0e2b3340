"""The step's verdict, riding in its push: whether the update applies, without a collective
of its own.

One device skips (or refuses) a step whose loss or aggregated gradient is NaN or infinite, and
skips a parameter no backward reached. Here that needs every rank's word: each worker's loss,
and the servers' sums of every worker's gradient rows. The check used to be a collective after
the push (`parallax.engine.optimizers.grad_norm.find_nonfinite`); on a CPU cluster each
collective costs a few milliseconds of waiting (record small_sums-2x2-1gbit), so the verdict now
travels *in* the push's first message (`Hop.carrying`), which every rank sends to every rank:

* whether this rank's loss is finite;
* a bound on what this rank adds to any aggregated gradient element: the sum over its pushed
  messages of their largest magnitude (pooled bags: ids x largest pooled gradient x largest
  weight). The servers' sum of all ranks' rows is at most the sum of the bounds, so when that
  is below half the dtype's largest value the aggregated gradient is finite (NaN or infinity
  anywhere makes the bound NaN or infinite);
* how many of this rank's shards held gradient from before this step (no ``zero_grad``
  since): their old values are not in the bound;
* whether a backward reached each server-held table on this rank (`Table.has_gradient`).

Every rank adds the ranks' verdicts in rank order (the same sum, bit for bit, everywhere), so
all decide alike. The verdict only ever says "finite" when the aggregated gradient is finite;
when it cannot say so (a non-finite loss or row, a bound too large, stale gradients) every
rank runs the full check, which names what is not finite. Clipping needs the aggregated
norm, so under `Config.clip_grad_norm` the full check runs as before.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from parallax.engine.tables.riders import rank_order_sum
from parallax.errors import InternalError

__all__ = ["VERDICT_KEY", "Verdict", "bound_of", "largest_magnitudes", "nonfinite_flag"]

#: the rider's name in a hop's message (not a parameter name: names have no parentheses)
VERDICT_KEY = "(verdict)"

_LOSS, _STALE, _BOUND, _REACHED = 0, 1, 2, 3  # fields of a rank's verdict


class Verdict:
    """One step's verdict, a rider (`parallax.engine.tables.riders`): this rank's
    (`prepare`), then all ranks' summed (`receive`)."""

    key = VERDICT_KEY

    def __init__(self, *, loss: Tensor | None = None) -> None:
        #: the step's loss (None: none is known), checked only where a push carries the
        #: verdict (`prepare`), on its device: a GPU's loss costs no synchronisation
        self.loss = loss
        #: the server-held tables whose reached flags ride, in the push's (agreed) order
        self.names: list[str] = []
        self.limit = 0.0
        #: this rank's verdict, until a message takes it (`board`)
        self.waiting: Tensor | None = None
        #: every rank's verdict added in rank order, once the push carried it
        self.summed: Tensor | None = None

    def prepare(self, *, names: Sequence[str], reached: Sequence[bool], stale: int,
                bound: Tensor, limit: float, world: int) -> None:
        """This rank's verdict, one row per peer (float64; see the module), waiting for the
        push's first message."""
        self.names, self.limit = list(names), limit
        # what the host knows, sent to the device in one copy that does not wait for it
        # (a blocking copy to a GPU synchronises the stream); then the device's values
        row = torch.tensor([0.0, float(stale), 0.0, *(float(r) for r in reached)],
                           dtype=torch.float64).to(bound.device, non_blocking=True)
        if self.loss is not None:
            row[_LOSS] = nonfinite_flag(self.loss)
        row[_BOUND] = bound
        self.waiting = row.expand(world, row.numel()).contiguous()

    def prepare_alone(self, *, world: int, device: torch.device) -> None:
        """`prepare` for a push of no server-held table (nothing aggregated on a server to
        bound, no such table to reach): this rank's loss alone, riding with the step's other
        riders (`parallax.engine.tables.riders.settle`)."""
        self.prepare(names=[], reached=[], stale=0,
                     bound=torch.zeros((), dtype=torch.float64, device=device),
                     limit=math.inf, world=world)

    def receive(self, received: Tensor) -> None:
        """Every rank's verdict (``[world, fields]``), added in rank order."""
        self.summed = rank_order_sum(received).cpu()

    @property
    def carried(self) -> bool:
        """Whether a push carried it (else the full check decides)."""
        return self.summed is not None

    def finite(self) -> bool:
        """Every loss is finite and every aggregated gradient provably so."""
        loss, stale, bound = self._summed()[[_LOSS, _STALE, _BOUND]].tolist()  # one read-back
        return bool(loss == 0.0 and stale == 0.0 and bound < self.limit)

    @property
    def stale_shards(self) -> int:
        """Shards that held gradient from before this push, summed over the ranks."""
        return int(self._summed()[_STALE])

    def reached(self) -> Tensor:
        """Per table of `names`: on how many ranks a backward reached it."""
        return self._summed()[_REACHED:]

    def _summed(self) -> Tensor:
        if self.summed is None:
            raise InternalError("parallax internal error: a verdict read before a push "
                                "carried it; please report it")
        return self.summed


def bound_of(grads: Sequence[Tensor], device: torch.device | None = None) -> Tensor:
    """The sum of the largest magnitudes of ``grads`` (float64; 0 for none, on ``device``): a
    bound on what they add to any one aggregated element when each row is summed in once."""
    tops = largest_magnitudes([grad.detach() for grad in grads])
    if tops is None:
        return torch.zeros((), dtype=torch.float64, device=device)
    return tops.to(torch.float64).sum()  # widened: the sum cannot overflow


def largest_magnitudes(tensors: Sequence[Tensor]) -> Tensor | None:
    """Each non-empty tensor's largest magnitude, stacked in order (None: every tensor
    empty, as an infinity norm of nothing is not defined): NaN and infinities survive a max,
    and a max of finite values cannot overflow. On a GPU one foreach kernel per device and
    dtype, as torch's clip_grad_norm_ computes norms; on the CPU each tensor's ``aminmax``,
    then one pass over all of them: the CPU's infinity norm is not vectorised (several times
    slower), and a step takes it twice a rank (the pulled rows' bound and the dense
    gradients' check)."""
    values = [tensor for tensor in tensors if tensor.numel()]
    if not values:
        return None
    if all(v.device.type == "cpu" and v.dtype.is_floating_point for v in values):
        ends = torch.stack([end for value in values for end in torch.aminmax(value)])
        return ends.abs().view(-1, 2).amax(1)  # (a NaN anywhere makes both ends NaN)
    return torch.stack(torch._foreach_norm(values, math.inf))


def nonfinite_flag(value: Tensor) -> Tensor:
    """Whether some element of ``value`` (a loss) is NaN or infinite, as a 0-dim bool tensor
    on its device, not read back: ``x - x`` is 0 for every finite ``x`` and NaN otherwise
    (three operators, where ``isfinite`` and its reduction take six)."""
    detached = value.detach()
    return (detached - detached).ne(0).any()
