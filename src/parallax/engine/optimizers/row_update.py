"""torch's own update applied to a parameter's touched rows alone, where that is exact.

Where a zero gradient leaves a row and its optimizer state exactly as they are
(`parallax.engine.optimizers.shard_optimizer.zero_gradient_is_identity`: plain SGD, Adagrad
without weight decay), only the rows that received gradient need the update. Handing torch's
optimizer a sparse gradient of those rows does it, but torch's sparse path costs about 126 host
operators per parameter (coalescing, sparse masks, sparse adds; measured on torch 2.13), which
on a GPU is the host's time per step (the GPU path). Here the rows are gathered, stepped by the
optimizer's own functional form (``torch.optim.adagrad.adagrad``, ``torch.optim.sgd.sgd``: the
dense program's arithmetic, element for element, which the sparse path is not: it divides
before it scales) and written back: about 35 operators.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.optim.adagrad import adagrad
from torch.optim.sgd import sgd

from parallax.errors import InternalError

__all__ = ["RowStep", "has_row_update", "update_rows"]


@dataclass(frozen=True)
class RowStep:
    """One parameter's part of a row update: its ``rows`` (unique row numbers) to step from
    those rows of its dense ``grad``, and the optimizer's ``state`` of ``param``."""

    param: Tensor
    grad: Tensor
    rows: Tensor
    state: dict[str, Any]


def has_row_update(optimizer_class: type[torch.optim.Optimizer], param: Tensor) -> bool:
    """Whether `update_rows` can step ``param`` under this class (torch's own SGD and
    Adagrad; real parameters: torch steps complex ones as real views)."""
    return (optimizer_class in (torch.optim.SGD, torch.optim.Adagrad)
            and not param.is_complex())


def update_rows(optimizer_class: type[torch.optim.Optimizer], group: dict[str, Any],
                steps: Sequence[RowStep]) -> None:
    """One step of ``optimizer_class`` with ``group``'s hyper-parameters on the rows of every
    parameter of ``steps``, in place, in one call of the optimizer's functional form over
    them all (as torch's ``step()`` steps a param group's parameters together: on a GPU its
    foreach kernels serve every table at once); Adagrad's ``sum`` rows and ``step`` advance
    as torch's step advances them. Only for `has_row_update` classes with a zero gradient
    an identity."""
    with torch.no_grad():
        if optimizer_class is torch.optim.SGD:
            _sgd_rows(group, steps)
        elif optimizer_class is torch.optim.Adagrad:
            _adagrad_rows(group, steps)
        else:
            raise InternalError(f"parallax internal error: no row update for "
                                f"{optimizer_class.__name__}; please report it")


def _sgd_rows(group: dict[str, Any], steps: Sequence[RowStep]) -> None:
    """Plain SGD (no momentum, no weight decay: the rows' update is the whole one)."""
    values = [step.param.index_select(0, step.rows) for step in steps]
    sgd(values, [step.grad.index_select(0, step.rows) for step in steps], [None] * len(steps),
        weight_decay=group["weight_decay"], momentum=group["momentum"], lr=group["lr"],
        dampening=group["dampening"], nesterov=group["nesterov"], maximize=group["maximize"],
        foreach=group.get("foreach"))
    for step, stepped in zip(steps, values, strict=True):
        step.param.index_copy_(0, step.rows, stepped)


def _adagrad_rows(group: dict[str, Any], steps: Sequence[RowStep]) -> None:
    values = [step.param.index_select(0, step.rows) for step in steps]
    sums = [step.state["sum"].index_select(0, step.rows) for step in steps]
    adagrad(values, [step.grad.index_select(0, step.rows) for step in steps], sums,
            [step.state["step"] for step in steps],
            lr=group["lr"], weight_decay=group["weight_decay"], lr_decay=group["lr_decay"],
            eps=group["eps"], maximize=group["maximize"],
            # the program's own form (None: torch's default for the rows' device, which is
            # the program's parameter's device)
            foreach=group.get("foreach"))
    for step, stepped, summed in zip(steps, values, sums, strict=True):
        step.param.index_copy_(0, step.rows, stepped)
        step.state["sum"].index_copy_(0, step.rows, summed)
