"""A step's gradients, wherever they live: the replicated parameters' ``.grad`` on every
worker, the split layers' shards (model parallelism), and the server-held tables' aggregated
rows on their servers.

One device's habits act on all of them alike: ``zero_grad`` clears every one, the global norm
sums every one, the finiteness check reads every one. `StepGradients` is that single view, so
the runner and the sync modes never walk the three kinds themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from parallax.cluster import WorkerInfo
from parallax.engine.optimizers.grad_norm import (
    NonFinite,
    all_finite_together,
    clip_by_global_norm,
    find_nonfinite,
    find_nonfinite_here,
)
from parallax.engine.optimizers.shard_optimizer import parameter_ids
from parallax.engine.tables import reduction
from parallax.engine.tables.after_aggregation import AfterAggregation, OnServers
from parallax.engine.tables.replicated import ReplicatedTable
from parallax.engine.tables.server_table import ShardedTable
from parallax.engine.tables.table import Table, held_tables
from parallax.engine.tables.verdict import Verdict
from parallax.errors import InternalError, UnsupportedProgramError
from parallax.parallelism import Parallelism

__all__ = ["StepGradients", "clear_grad"]


class StepGradients:
    """The gradients of one run's parameters. ``tables`` returns the current tables by
    parameter name (the warm-up may move one to AllReduce); ``replicated`` is the runner's
    list of parameters every worker holds whole (the same list object: moved tables join
    it)."""

    def __init__(self, model: nn.Module, params: dict[str, nn.Parameter],
                 tables: Callable[[], dict[str, Table]],
                 replicas: Callable[[], list[ReplicatedTable]], replicated: list[nn.Parameter],
                 split: list[nn.Parameter], parallelism: Parallelism, *, worker: WorkerInfo,
                 group: dist.ProcessGroup, device: torch.device,
                 after_aggregation: AfterAggregation | None = None) -> None:
        self.model = model
        self.params = params
        self.tables = tables
        self.replicas = replicas  # the replicated tables, in name order
        self.replicated = replicated
        self.split = split
        self.parallelism = parallelism
        self.worker = worker
        self.group = group
        self.device = device
        #: where the element-wise operations on the servers' aggregates run
        #: (`Config.after_aggregation`)
        self.after_aggregation: AfterAggregation = after_aggregation or OnServers()
        self._named: tuple[int, list[tuple[str, nn.Parameter]]] | None = None
        #: the tables' summed squared norm of this step, when the finiteness check has it
        self.tables_squared: Tensor | None = None
        #: the norm `Config.clip_grad_norm` clipped by, at the latest step that clipped
        self.last_norm: float | None = None
        #: factors the program scaled a server-held table's ``.grad`` by before the push
        #: (``p.grad.div_(k)``), by parameter name: applied to the aggregated rows after it
        self.program_scales: dict[str, float] = {}

    # ---- which gradients ---------------------------------------------------------------------
    def tables_of(self, optimizers: Sequence[torch.optim.Optimizer]) -> list[Table]:
        """The tables whose parameters ``optimizers`` hold."""
        return self._tables_with(parameter_ids(optimizers))

    def _tables_with(self, ids: set[int] | None) -> list[Table]:
        """The tables whose parameter's id is in ``ids`` (None: every table)."""
        return [t for name, t in self.tables().items()
                if ids is None or id(self.params[name]) in ids]

    def server_held(self) -> list[ShardedTable]:
        """The server-held tables (`Table.held`), whose rows the servers aggregate."""
        return list(held_tables(self.tables()).values())

    def replicated_named(self) -> list[tuple[str, nn.Parameter]]:
        """The replicated parameters with their names in the user's model (found again only
        when the list changed: a table the warm-up moved joins it; the finiteness check
        asks every step)."""
        key = len(self.replicated)  # (the list only grows: a moved table joins it)
        if self._named is None or self._named[0] != key:
            ids = set(map(id, self.replicated))
            self._named = (key, [(n, p) for n, p in self.model.named_parameters()
                                 if id(p) in ids])
        return self._named[1]

    def scale_table_grad(self, name: str, factor: float, *, aggregated: bool) -> None:
        """The program scaled server-held ``name``'s ``.grad`` by ``factor`` in place: the
        aggregated rows now (``aggregated``: the push is done), or once pushed."""
        if aggregated:
            self.tables()[name].scale_grad(torch.tensor(factor, dtype=torch.float64))
        else:
            self.program_scales[name] = self.program_scales.get(name, 1.0) * factor

    def apply_program_scales(self) -> None:
        """After the push: the factors the program scaled the tables' ``.grad`` by, on the
        aggregated rows (the sum of the workers' scaled rows is the scaled sum)."""
        if not self.program_scales:  # (the usual step: nothing scaled)
            return
        tables = self.tables()
        for name, factor in self.program_scales.items():
            tables[name].scale_grad(torch.tensor(factor, dtype=torch.float64))
        self.program_scales.clear()

    # ---- one device's habits -----------------------------------------------------------------
    def zero_grad(self, optimizers: Sequence[torch.optim.Optimizer] | None = None, *,
                  set_to_none: bool = True) -> None:
        """Clear every gradient, or those of the parameters ``optimizers`` update, as
        ``Optimizer.zero_grad(set_to_none)`` does on one device."""
        mine = None if optimizers is None else parameter_ids(optimizers)
        tables = self._tables_with(mine)
        scaled = self.program_scales
        for table in tables:  # first: a replicated table keeps its cleared gradient's buffer
            table.zero_grad(set_to_none=set_to_none)
            if scaled:
                scaled.pop(table.name, None)
        params = [*self.replicated, *self.split]
        # (no test per parameter where the optimizers hold them all: this runs every step)
        if mine is not None and not mine.issuperset(map(id, params)):
            params = [param for param in params if id(param) in mine]
        if set_to_none:
            for param in params:
                param.grad = None
            return
        for param in params:
            clear_grad(param, set_to_none)

    def clip(self, max_norm: float, parameters: Iterable[nn.Parameter] | None = None, *,
             error_if_nonfinite: bool = False) -> float:
        """Clip the aggregated gradients of ``parameters`` (default: all) by their global L2
        norm, as ``clip_grad_norm_`` does on one device; returns the norm. Collective.
        ``error_if_nonfinite``: a NaN or infinite norm raises (every rank has the same norm)
        before anything is scaled."""
        wanted = None if parameters is None else {id(p) for p in parameters}
        everything_of = self.tables()
        tables = [t for name, t in everything_of.items()
                  if wanted is None or id(self.params[name]) in wanted]
        grads = [p.grad for p in self.replicated
                 if p.grad is not None and (wanted is None or id(p) in wanted)]
        everything = wanted is None or len(tables) == len(everything_of)
        parts = self.parallelism.norm_parts()  # split parameters' shards, like tables
        chosen = [part for part in parts.values() if wanted is None or id(part.param) in wanted]
        everything = everything and len(chosen) == len(parts)
        ours = [t for t in tables if isinstance(t, ReplicatedTable) and t.grad_is_ours()]
        norm = clip_by_global_norm(
            max_norm, grads, [*tables, *chosen],
            tables_squared=self.tables_squared if everything else None,
            group=self.group, device=self.device, error_if_nonfinite=error_if_nonfinite,
            scale=self._scale_tables)
        for table in ours:
            table.grad_rescaled()
        return norm

    def _scale_tables(self, tables: Sequence[Any], factor: Tensor) -> None:
        """Clipping's scale of ``tables``' aggregated gradients: the server-held ones' where
        `Config.after_aggregation` runs it, the others' where they are."""
        self.after_aggregation.scale([t for t in tables if isinstance(t, ShardedTable)], factor)
        for table in tables:
            if not isinstance(table, ShardedTable):
                table.scale_grad(factor)

    def clamp(self, value: float, parameters: Iterable[nn.Parameter] | None = None) -> None:
        """Clamp the aggregated gradients of ``parameters`` (default: all) to ``[-value,
        value]`` element by element, as ``clip_grad_value_`` does on one device. Each rank
        clamps what it holds (the replicas alike): no collective."""
        wanted = None if parameters is None else {id(p) for p in parameters}
        tables = [t for name, t in self.tables().items()
                  if wanted is None or id(self.params[name]) in wanted]
        for param in self.replicated:
            grad = param.grad
            if grad is not None and (wanted is None or id(param) in wanted):
                (grad._values() if grad.is_sparse else grad).clamp_(-value, value)
        for table in tables:
            table.clamp_grad(value)
            if isinstance(table, ReplicatedTable) and table.grad_is_ours():
                table.grad_rescaled()  # zero rows stayed zero
        for part in self.parallelism.norm_parts().values():
            if wanted is None or id(part.param) in wanted:
                part.clamp_grad(value)

    def unscale_tables(self, optimizers: Sequence[torch.optim.Optimizer],
                       inv_scale: Tensor) -> bool:
        """Multiply the aggregated rows of the tables ``optimizers`` update by ``inv_scale``;
        whether any of them is NaN or infinite (collective: the same answer everywhere)."""
        squared = torch.zeros((), dtype=torch.float64, device=self.device)
        for table in self.tables_of(optimizers):
            table.scale_grad(inv_scale)
            squared += table.grad_norm_squared()
        reduction.all_reduce(squared, group=self.group)
        return not bool(torch.isfinite(squared))

    def reduce_split_layers(self) -> None:
        """The split layers' gradients (model parallelism) reduced over the data groups."""
        self.parallelism.reduce_gradients()

    # ---- checks ------------------------------------------------------------------------------
    def check_none_outside_lookups(self) -> None:
        """A server-held parameter gets its gradient through its lookups only; one that the
        program read directly (a loss term on the whole table, under ps a dense weight used
        outside the model's forward) has a gradient nobody would push: refused."""
        held = [name for name, table in self.tables().items() if table.on_servers]
        if not held:
            return
        # (the handle's own gradient, read as a plain tensor's: no torch function per table)
        with torch._C.DisableTorchFunctionSubclass():
            used = [name for name in held if self.params[name].grad is not None]
        if used:
            raise UnsupportedProgramError(
                f"rank {self.worker.rank}: parameter(s) {used} live on the parameter servers, "
                f"but the program computed a gradient for them outside the model's lookups "
                f"(e.g. a loss term on the whole weight); their values here are not the "
                f"servers' and that gradient would be lost. Compute such terms from the "
                f"model's outputs, or use architecture='allreduce' for these parameters.")

    def find_nonfinite(self, loss: Tensor | None) -> NonFinite:
        """Every worker's loss and every aggregated gradient checked in one collective, which
        also tells each server-held table whether any backward reached it and keeps the
        tables' squared norm for clipping."""
        # (a replica's gradient is checked with the dense ones: its norm part is zero)
        held = {name: table for name, table in self.tables().items() if table.on_servers}
        parts = self.parallelism.norm_parts()
        if (self.worker.world_size == 1 or loss is None) and not held and not parts:
            # nothing elsewhere: every gradient is whole and the same on every rank, and no
            # rank's loss is asked for (the own loop's optimizer.step), so each rank's answer
            # is every rank's, with no collective (no table has a norm part: zero)
            self.tables_squared = (None if self.worker.world_size == 1 else  # (no operator)
                                   torch.zeros((), dtype=torch.float64, device=self.device))
            return find_nonfinite_here(loss, self._replicated_grads_to_check())
        found = find_nonfinite(loss, {**held, **parts},
                               self._replicated_grads_to_check(),
                               rank=self.worker.rank, world=self.worker.world_size,
                               group=self.group, device=self.device,
                               flags=self._reached_flags())
        self.agree_on_tables(found.flags)
        self.tables_squared = found.tables_squared
        return found

    def finite_by(self, verdict: Verdict) -> bool:
        """Whether the push's ``verdict`` (`parallax.engine.tables.verdict`) proves the step
        finite: every loss and server-held gradient by the verdict, the replicated gradients
        here (summed alike on every rank, so every rank answers alike). Split layers' shards
        are not in the verdict: with them, False (the full check decides)."""
        return (verdict.finite() and not self.parallelism.norm_parts()
                and all_finite_together(grad for _, grad in self._replicated_grads_to_check()))

    def _replicated_grads_to_check(self) -> list[tuple[str, Tensor | None]]:
        """The replicated gradients by name; of a replicated table whose gradient is the
        exchange's own, only its touched rows (the rest are zeros it wrote): a table of
        millions of rows is not read whole each step for the few hundred a batch touched."""
        if not self.replicas():  # (no loop per parameter: this runs every step)
            return [(name, param.grad) for name, param in self.replicated_named()]
        replicas = {table.name: table for table in self.replicas()}
        checked: list[tuple[str, Tensor | None]] = []
        for name, param in self.replicated_named():
            grad, table = param.grad, replicas.get(name)
            if grad is not None and not grad.is_sparse and table is not None:
                rows = table.touched_rows()
                if rows is not None:
                    grad = grad[rows]
            checked.append((name, grad))
        return checked

    def agree_by(self, verdict: Verdict) -> None:
        """`agree_on_tables` from the counts the push's ``verdict`` carried."""
        counts = dict(zip(verdict.names, verdict.reached().tolist(), strict=True))
        for table in self.server_held():
            if table.name not in counts:
                raise InternalError(f"parallax internal error: table '{table.name}' missing "
                                    f"from the step's verdict; please report it")
            table.gradient_anywhere = counts[table.name] > 0

    def agree_on_tables(self, summed: Tensor | None = None) -> None:
        """Tell each server-held table whether any worker's backward reached it since its
        gradient was cleared (``summed``: `_reached_flags` summed over the ranks; None: sum
        them now, collective). One device skips a parameter whose ``.grad`` is None; the
        servers skip such a table alike."""
        tables = self.server_held()
        if not tables:
            return
        if summed is None:
            summed = self._reached_flags()
            reduction.all_reduce(summed, group=self.group)
        for table, count in zip(tables, summed.tolist(), strict=True):
            table.gradient_anywhere = count > 0

    def _reached_flags(self) -> Tensor:
        """Whether a backward reached each server-held table on this worker, 1.0 or 0.0."""
        return torch.tensor([float(t.has_gradient) for t in self.server_held()],
                            dtype=torch.float64, device=self.device)


def clear_grad(param: Tensor, set_to_none: bool) -> None:
    """``Optimizer.zero_grad``'s clearing of one parameter's gradient (torch has no public
    helper for one parameter)."""
    if param.grad is None or set_to_none:
        param.grad = None
    elif param.grad.grad_fn is not None:
        param.grad.detach_().zero_()
    else:
        param.grad.requires_grad_(False).zero_()
