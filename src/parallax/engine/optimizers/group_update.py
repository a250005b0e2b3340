"""One row update for a table group: its members' touched rows stepped as one parameter.

A table group's members live end to end in one store on each server, their dense gradients
in one gradient (`parallax.engine.tables.table_group`). Where every member of a group takes
the row update of one param group in a step (`parallax.engine.optimizers.row_update`), the
update is one `RowStep` over the store: the members' touched rows, shifted to the store's
rows, in one gather, one functional call and one write-back, instead of one of each per
member. Exact: torch's SGD and Adagrad act element by element, so stepping the rows of the
members together computes each element as stepping each member alone does; Adagrad's
per-row ``sum`` is then held as one store too (each member's state a view of it, as its
rows are), and its step count, a number per member, must be the same for every member (it
is advanced once and copied to the others). Anything else (a member missing from the step,
its rows or state held elsewhere, step counts that differ) keeps the members' own steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from parallax.engine.optimizers.row_update import RowStep

__all__ = ["fuse_group_steps"]


def fuse_group_steps(optimizer_class: type[torch.optim.Optimizer],
                     entries: Sequence[tuple[Any, RowStep]],
                     ) -> tuple[list[RowStep], list[Callable[[], None]]]:
    """The row steps of one param group of ``optimizer_class`` (``(table, step)`` pairs),
    each table group whose members are all here as one step; with what to do after the
    update (the other members' step counts set to the one that advanced)."""
    steps: list[RowStep] = []
    after: list[Callable[[], None]] = []
    by_group: dict[int, list[tuple[Any, RowStep]]] = {}
    for table, step in entries:
        group = getattr(table, "store_group", None)
        if group is None:
            steps.append(step)
        else:
            by_group.setdefault(id(group), []).append((table, step))
    for members in by_group.values():
        fused = _fused(optimizer_class, members)
        if fused is None:
            steps.extend(step for _, step in members)
            continue
        steps.append(fused[0])
        if fused[1] is not None:
            after.append(fused[1])
    return steps, after


def _fused(optimizer_class: type[torch.optim.Optimizer], members: list[tuple[Any, RowStep]],
           ) -> tuple[RowStep, Callable[[], None] | None] | None:
    """One step over the store of ``members``' group, or None where it would not be exact.
    (One loop of assignments over the members, not generators or comprehensions: this runs
    every step for every group, and the host's calls are what it costs.)"""
    if optimizer_class not in (torch.optim.SGD, torch.optim.Adagrad):
        return None
    group = members[0][0].store_group
    count = len(group.members)
    if len(members) != count:
        return None  # (a member takes no update this step)
    order, starts = group.member_index, group.store_starts()
    params: list[Any] = [None] * count
    grads: list[Any] = [None] * count
    rows: list[Any] = [None] * count
    states: list[Any] = [None] * count
    for table, step in members:  # (in store order)
        k = order[table.name]
        params[k], grads[k], states[k] = step.param, step.grad, step.state
        rows[k] = step.rows if starts[k] == 0 else step.rows + starts[k]
    store, grad = group.store_and_gradient(params, grads)
    if store is None or grad is None:
        return None
    if optimizer_class is torch.optim.SGD:  # (plain: no state to step)
        return RowStep(store, grad, torch.cat(rows), {}), None
    return _adagrad_step(group, states, store, grad, torch.cat(rows))


def _adagrad_step(group: Any, states: list[dict[str, Any]], store: Tensor, grad: Tensor,
                  rows: Tensor) -> tuple[RowStep, Callable[[], None]] | None:
    """Adagrad's: its ``sum`` as one store, its step count the same for every member (read
    on the host: counts kept on a device, under ``capturable``, are not fused)."""
    count = len(states)
    counts: list[Any] = [None] * count
    sums: list[Any] = [None] * count
    for k in range(count):
        counts[k], sums[k] = states[k].get("step"), states[k].get("sum")
    if (None in counts or {c.device.type for c in counts} != {"cpu"}
            or len(set(map(float, counts))) != 1):
        return None
    summed = group.state_store("sum", sums)
    if summed is None:
        return None
    for state, view in zip(states, group.state_views("sum"), strict=True):
        state["sum"] = view
    first, others = counts[0], counts[1:]

    def finish() -> None:  # (the other members' counts advance as the first one did)
        for other in others:
            other.copy_(first)
    return RowStep(store, grad, rows, {"sum": summed, "step": first}), finish
