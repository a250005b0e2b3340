"""The aggregated gradient's norm and finiteness, over replicas and server shards alike.

On one device, ``clip_grad_norm_`` sees every gradient; here the dense ones (and replicated
tables') are whole on every worker after the AllReduce, while each server holds the aggregated
rows of its own shards. So each table contributes its servers' partial squared norms, summed in
one collective, and the dense part is added locally on every worker: every worker computes the
same total, clips alike, and decides alike whether a step is finite.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from parallax.engine.tables import reduction
from parallax.engine.tables.table import Table
from parallax.engine.tables.verdict import largest_magnitudes, nonfinite_flag
from parallax.errors import NonFiniteError

__all__ = ["NonFinite", "all_finite", "all_finite_together", "clip_by_global_norm",
           "find_nonfinite", "find_nonfinite_here", "finite_together"]


class NonFinite:
    """What `find_nonfinite` found: ranks whose loss and parameters whose aggregated gradient
    are NaN/Inf (both empty when the step is finite), and the tables' summed squared norm."""

    def __init__(self, ranks: list[int], parameters: list[str], tables_squared: Tensor | None,
                 flags: Tensor | None = None):
        self.ranks = ranks
        self.parameters = parameters
        self.tables_squared = tables_squared
        self.flags = flags  # the ``flags`` passed in, summed over the ranks

    def __bool__(self) -> bool:
        return bool(self.ranks or self.parameters)

    def describe(self) -> str:
        return " and ".join(part for part in (
            f"loss on rank(s) {self.ranks}" if self.ranks else "",
            f"aggregated gradient of {self.parameters}" if self.parameters else "") if part)


def find_nonfinite(loss: Tensor | None, tables: dict[str, Table],
                   dense: Sequence[tuple[str, Tensor | None]], *, rank: int, world: int,
                   group: dist.ProcessGroup, device: torch.device,
                   flags: Tensor | None = None) -> NonFinite:
    """Every worker's loss (when given) and every aggregated gradient checked in one small
    collective, which also yields the tables' part of the squared norm (reused by clipping)
    and sums ``flags`` (per-rank counts riding along, to save a collective)."""
    named = list(tables.items())
    extra = 0 if flags is None else flags.numel()
    values = torch.zeros(world + len(named) + extra, dtype=torch.float64, device=device)
    if flags is not None:
        values[world + len(named):] = flags
    if loss is not None:  # (no host round trip: on a GPU each is a synchronisation)
        values[rank] = nonfinite_flag(loss)
    for i, (_, table) in enumerate(named):  # server-held: each server its own rows
        values[world + i] = table.grad_norm_squared()
    reduction.all_reduce(values, group=group)
    dense_finite = finite_together(grad for _, grad in dense)
    if dense_finite is None:
        dense_finite = torch.ones((), dtype=torch.bool, device=device)
    # every flag in one read-back (on a GPU each read is a synchronisation); nothing is
    # computed for tables where there are none (a world of one's own tables)
    squared = values[world:world + len(named)]
    parts = [values[:world] > 0, (squared - squared).eq(0)] if named else [values[:world] > 0]
    read = torch.cat([*parts, dense_finite.reshape(1)]).tolist()
    ranks_bad, tables_finite = read[:world], read[world:world + len(named)]
    bad = [name for (name, _), finite in zip(named, tables_finite, strict=True) if not finite]
    if not read[-1]:  # names only when one is bad
        bad += [name for name, grad in dense if grad is not None and not all_finite(grad)]
    return NonFinite([r for r in range(world) if ranks_bad[r]], bad,
                     squared.sum() if named else values.new_zeros(()),
                     None if flags is None else values[world + len(named):])


def find_nonfinite_here(loss: Tensor | None,
                        dense: Sequence[tuple[str, Tensor | None]]) -> NonFinite:
    """`find_nonfinite` where every gradient is here (a world of one, no table on a server
    and no split layer): the loss and the gradients in one fused check and one read-back,
    no collective; what is not finite is named only when something is. ``tables_squared`` is
    None: no table has a norm part."""
    checked = [grad for _, grad in dense]
    if loss is not None:
        checked.append(loss.detach().reshape(1))
    finite = finite_together(checked)
    if finite is None or bool(finite):
        return NonFinite([], [], None)
    ranks = [0] if loss is not None and not all_finite(loss.detach()) else []
    return NonFinite(ranks, [name for name, grad in dense
                             if grad is not None and not all_finite(grad)], None)


def clip_by_global_norm(max_norm: float, dense_grads: Sequence[Tensor], tables: Sequence[Table],
                        *, tables_squared: Tensor | None, group: dist.ProcessGroup,
                        device: torch.device, error_if_nonfinite: bool = False,
                        scale: Callable[[Sequence[Table], Tensor], None] | None = None,
                        ) -> float:
    """Scale every gradient by ``min(1, max_norm / (norm + 1e-6))`` as ``clip_grad_norm_``
    does on one device; ``tables_squared`` when `find_nonfinite` summed it already.
    Returns the norm before clipping (collective unless ``tables_squared`` is given).
    ``error_if_nonfinite``: raise `NonFiniteError` on a NaN or infinite norm (the same on
    every rank), nothing scaled, as torch's ``error_if_nonfinite=True``. ``scale``: how the
    tables' gradients are multiplied by the clip's factor (default: each table's
    ``scale_grad``)."""
    if tables_squared is not None:
        squared = tables_squared.clone()
    else:
        squared = torch.zeros((), dtype=torch.float64, device=device)
        for table in tables:
            squared += table.grad_norm_squared()
        if tables:
            reduction.all_reduce(squared, group=group)
    for grad in dense_grads:  # replicated sparse-gradient tables arrive coalesced
        values = grad._values() if grad.is_sparse else grad
        squared += torch.linalg.vector_norm(values, dtype=torch.float64) ** 2
    total = squared.sqrt()
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise NonFiniteError(
            f"the total norm of order 2.0 of the aggregated gradients is {float(total)}, so "
            f"it cannot be clipped (nothing was): to scale the gradients by the non-finite "
            f"norm anyway, set error_if_nonfinite=False, as with torch's clip_grad_norm_")
    factor = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in dense_grads:
        grad.mul_(factor.to(grad.dtype))
    if scale is not None:
        scale(tables, factor)
    else:
        for table in tables:
            table.scale_grad(factor)
    return float(total)


def all_finite(grad: Tensor) -> bool:
    """Whether every value of ``grad`` (dense, or a sparse COO tensor's values) is finite."""
    values = grad._values() if grad.is_sparse else grad
    return bool(torch.isfinite(values).all())


def all_finite_together(grads: Iterable[Tensor | None]) -> bool:
    """`all_finite` of every gradient (None: none), read back once rather than once each (on a
    GPU every read-back is a synchronisation)."""
    finite = finite_together(grads)
    return finite is None or bool(finite)


def finite_together(grads: Iterable[Tensor | None]) -> Tensor | None:
    """Whether every value of every gradient (None: none) is finite, as a 0-dim bool tensor
    on the gradients' device, not read back; None where there is no gradient.

    One fused operator per device and dtype, the one ``torch.amp.GradScaler`` checks its
    gradients with (``_amp_foreach_non_finite_check_and_unscale_``, scale 1: each value is
    multiplied by one, which leaves it bitwise as it was, and the version counters as they
    are); a dtype it does not take goes by `largest_magnitudes`."""
    values = [grad._values() if grad.is_sparse else grad for grad in grads if grad is not None]
    if not values:
        return None
    kinds = {(value.device, value.dtype) for value in values}
    if len(kinds) == 1:  # (the usual step: one device, one dtype; no loop per gradient)
        ((where, dtype),) = kinds
        if dtype in _CHECKED_FUSED:
            return _fused_check(values, where).view(()).eq(0)
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    others = []
    for value in values:
        if value.dtype in _CHECKED_FUSED:
            groups.setdefault((value.device, value.dtype), []).append(value)
        else:
            others.append(value)
    device = values[0].device
    flags = [_fused_check(members, where) for (where, _), members in groups.items()]
    finite = torch.cat([flag.to(device) for flag in flags]).eq(0).all() if flags else None
    tops = largest_magnitudes(others) if others else None
    if tops is None:
        assert finite is not None
        return finite
    others_finite = tops.isfinite().all().to(device)
    return others_finite if finite is None else finite & others_finite


def _fused_check(values: list[Tensor], device: torch.device) -> Tensor:
    """A one-element count, non-zero where some value of ``values`` (one device and dtype)
    is NaN or infinite: torch's fused check with scale 1."""
    found = torch.zeros(1, dtype=torch.float32, device=device)
    # no autograd: a gradient of a create_graph backward has a graph of its own (the mode set
    # directly, not by a torch.no_grad() context: this runs every step)
    enabled = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)
    try:
        torch._amp_foreach_non_finite_check_and_unscale_(values, found, _one(device))
    finally:
        torch._C._set_grad_enabled(enabled)
    return found


@functools.lru_cache(maxsize=16)
def _one(device: torch.device) -> Tensor:
    """The scale 1 of the fused check, made once per device (never written)."""
    return torch.ones((), dtype=torch.float32, device=device)


# the dtypes torch's fused check takes
_CHECKED_FUSED = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
