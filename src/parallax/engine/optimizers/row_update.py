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

from typing import Any

import torch
from torch import Tensor
from torch.optim.adagrad import adagrad

from parallax.engine.optimizers.deferred_sgd import sgd_rows
from parallax.errors import InternalError

__all__ = ["has_row_update", "update_rows"]


def has_row_update(optimizer_class: type[torch.optim.Optimizer], param: Tensor) -> bool:
    """Whether `update_rows` can step ``param`` under this class (torch's own SGD and
    Adagrad; real parameters: torch steps complex ones as real views)."""
    return (optimizer_class in (torch.optim.SGD, torch.optim.Adagrad)
            and not param.is_complex())


def update_rows(optimizer_class: type[torch.optim.Optimizer], group: dict[str, Any],
                state: dict[str, Any], param: Tensor, grad: Tensor, rows: Tensor) -> None:
    """One step of ``optimizer_class`` with ``group``'s hyper-parameters on ``rows`` (unique
    row numbers) of ``param``, from those rows of the dense ``grad``, in place; ``state`` is
    the optimizer's state of ``param`` (Adagrad's ``sum`` rows and ``step`` advance as torch's
    step advances them). Only for `has_row_update` classes with a zero gradient an identity."""
    with torch.no_grad():
        if optimizer_class is torch.optim.SGD:
            sgd_rows(param, grad, None, rows, group)
        elif optimizer_class is torch.optim.Adagrad:
            _adagrad_rows(group, state, param, grad, rows)
        else:
            raise InternalError(f"parallax internal error: no row update for "
                                f"{optimizer_class.__name__}; please report it")


def _adagrad_rows(group: dict[str, Any], state: dict[str, Any], param: Tensor, grad: Tensor,
                  rows: Tensor) -> None:
    values, sums = param.index_select(0, rows), state["sum"].index_select(0, rows)
    adagrad([values], [grad.index_select(0, rows)], [sums], [state["step"]],
            lr=group["lr"], weight_decay=group["weight_decay"], lr_decay=group["lr_decay"],
            eps=group["eps"], maximize=group["maximize"],
            # the program's own form (None: torch's default for the rows' device, which is
            # the program's parameter's device)
            foreach=group.get("foreach"))
    param.index_copy_(0, rows, values)
    state["sum"].index_copy_(0, rows, sums)
