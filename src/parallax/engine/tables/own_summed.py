"""A table the plan replicated on several workers, read as the program's own parameter: what
DDP does with an ``nn.Embedding``.

Where the hybrid moves a table to AllReduce (its measured α makes the whole gradient cheaper
than the servers' rows) and its layer makes a dense gradient that does not depend on the batch,
each worker's layer reads the whole weight as the plain layer does (``F.embedding`` over it:
no dedup, no leaf rows), and the gradient that travels is autograd's own dense one. Each
backward's gradient of the weight is caught before it reaches ``.grad`` (`_Caught`), and the
caught gradients of every such table go in one AllReduce (`SummedOwnTable.push_together`),
with one flag per table that says whether any worker's backward reached it: at the end of the
own loop's backward (`parallax.engine.tables.backward_push`: the program may read ``.grad``
before the step) or at the step (`Runner.step`). A caught gradient is summed, never the
accumulated ``.grad``, so several backward passes before a step add up as on one device in a
sum as in a mean.

An id outside the table fails every rank alike: every rank's flag (and bad id) is gathered
before any rank reads, and every rank raises the servers' `SparseIdError` for the first
(`parallax.engine.tables.exchange.raise_bad_ids`). Where the forward's id look-ahead
(`parallax.model.lookahead`) foresaw the lookups, the flags of all such tables ride in the
forward's loop-order message (`agree_ahead`: one collective a forward, whatever the number of
tables and lookups); a lookup no look-ahead foresaw gathers its own.
Implements `parallax.engine.tables.table.Table`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from parallax.cluster import WorkerInfo
from parallax.engine import process_group
from parallax.engine.tables import reduction
from parallax.engine.tables.exchange import BAD_ID, Traffic, raise_bad_ids
from parallax.engine.tables.own import OwnTable
from parallax.engine.tables.riders import Rider
from parallax.engine.tables.verdict import Verdict
from parallax.errors import InternalError

__all__ = ["SummedOwnTable"]


class _Caught(torch.autograd.Function):
    """The weight as the layer reads it; its gradient goes to the table, not to ``.grad``
    (the table's push adds the workers' sum there)."""

    @staticmethod
    def forward(ctx: Any, weight: Tensor, table: SummedOwnTable) -> Tensor:
        ctx.table = table
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None]:
        ctx.table.catch(grad)
        return None, None


class SummedOwnTable(OwnTable):
    """The program's own parameter on every worker, its gradient summed over them."""

    sync = "allreduce"  # the plan's word: the whole gradient AllReduced, as a dense one
    exchanges = True  # (its gradient is summed at the step, its ids agreed at each lookup)

    def __init__(self, name: str, param: nn.Parameter, *, worker: WorkerInfo,
                 group: dist.ProcessGroup, traffic: Traffic, average: bool) -> None:
        self._hold(name, param, worker)
        self.group = group
        self.traffic = traffic
        self.average = average
        self._caught: Tensor | None = None  # this table's gradient not yet pushed
        self._summed_after_backward = False  # pushed at a backward's end since the step
        #: inside a forward whose look-ahead agreed its ids (`agree_ahead`): those ids
        self.agreed_ahead: list[Tensor] | None = None
        #: called at the first gradient a backward catches (`BackwardPush`: the own loop)
        self.on_catch: Callable[[], None] | None = None

    def lookup(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """The whole weight (through `_Caught` where a gradient is made) and the ids, once
        every rank knows its ids are inside the table."""
        agreed = self.agreed_ahead
        if agreed is None:
            self._agree_ids(self.bad_id_in(ids))
        elif not any([ids is known for known in agreed]) and self.bad_id_in(ids) is not None:
            # (ids computed in the forward beside the look-ahead's: the same values)
            raise InternalError(
                f"parallax internal error: rank {self.worker.rank} looked up ids of "
                f"'{self.name}' outside its rows that the look-ahead did not see; please "
                f"report it")
        weight = (_Caught.apply(self.param, self)  # type: ignore[no-untyped-call]
                  if torch.is_grad_enabled() and self.param.requires_grad else self.param)
        return weight, ids

    def bad_id_in(self, ids: Tensor) -> int | None:
        """The first id of ``ids`` outside the table's rows (the lowest if negative, else
        the highest), or None (no collective)."""
        flat = ids.detach().reshape(-1)
        if not flat.numel():
            return None
        low, high = torch.stack(torch.aminmax(flat)).tolist()
        return low if low < 0 else high if high >= self.num_rows else None

    @staticmethod
    @contextmanager
    def agree_ahead(looked: dict[SummedOwnTable, list[Tensor]],
                    gather: Callable[[Sequence[float]], list[list[float]]]) -> Iterator[None]:
        """Before a forward whose look-ahead computed the ids of these tables' lookups
        (``looked``, in the same order on every rank): every rank's first bad id among them
        through ``gather`` (every rank's numbers, one collective: the forward's loop-order
        message), `SparseIdError` on every rank alike for the first; inside, their lookups
        gather nothing."""
        tables = list(looked)
        mine: tuple[float, float] = (0.0, 0.0)
        for index, (table, ids) in enumerate(looked.items()):
            bad = next((b for b in map(table.bad_id_in, ids) if b is not None), None)
            if bad is not None:
                mine = (float(index + 1), float(bad))
                break
        everyone = gather(mine)
        if any([row[0] for row in everyone]):
            first = tables[0]
            raise_bad_ids([[[0, BAD_ID if row[0] == t + 1 else 0, int(row[1])]
                            for t in range(len(tables))] for row in everyone],
                          [t.name for t in tables], traffic=first.traffic,
                          num_rows={t.name: t.num_rows for t in tables})
        for table, ids in looked.items():
            table.agreed_ahead = ids
        try:
            yield
        finally:
            for table in tables:
                table.agreed_ahead = None

    def _agree_ids(self, bad_id: int | None) -> None:
        """Raise `SparseIdError` on every rank alike when any rank's ids leave the table
        (one all_gather of each rank's flag and bad id, read back once)."""
        world = self.worker.world_size
        mine = torch.tensor([BAD_ID if bad_id is not None else 0, bad_id or 0],
                            dtype=torch.long, device=self.param.device)
        everyone = mine.new_empty(2 * world)
        process_group.all_gather_single(everyone, mine, group=self.group)
        values = everyone.tolist()
        if any(values[0::2]):
            raise_bad_ids([[[0, values[2 * r], values[2 * r + 1]]] for r in range(world)],
                          [self.name], traffic=self.traffic, num_rows={self.name: self.num_rows})

    def catch(self, grad: Tensor) -> None:
        """A backward's gradient of the weight (summed with what this step caught before)."""
        self._caught = grad if self._caught is None else self._caught + grad
        if self.on_catch is not None:
            self.on_catch()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The weight's gradient is cleared with the dense parameters'; a gradient caught and
        not pushed is dropped with it (a backward whose step never came)."""
        self._caught = None

    def push_gradients(self) -> None:
        SummedOwnTable.push_together([self])

    @staticmethod
    def push_after_backward(tables: Sequence[SummedOwnTable]) -> None:
        """The own loop's backward ended (`parallax.engine.tables.backward_push`): push every
        such table now, so that ``.grad`` is the workers' sum until the step, which then
        pushes nothing more."""
        _sum_by_dtype(tables)
        for table in tables:
            table._summed_after_backward = True

    @staticmethod
    def push_together(tables: Sequence[OwnTable], verdict: Verdict | None = None,
                      riders: Sequence[Rider] = ()) -> None:
        """Every table's caught gradient (zeros where none), summed over the workers in one
        AllReduce per dtype with a flag per table (did any worker catch one?), then added to
        ``.grad`` (set where it is None, as autograd accumulates); nothing at a step whose
        backward passes pushed them all already. The verdict rides elsewhere."""
        summed = cast("list[SummedOwnTable]", list(tables))  # (push_all: one kind's tables)
        if all(table._summed_after_backward for table in summed):
            for table in summed:
                table._summed_after_backward = False
            return
        _sum_by_dtype(summed)


def _sum_by_dtype(tables: Sequence[SummedOwnTable]) -> None:
    by_dtype: dict[torch.dtype, list[SummedOwnTable]] = {}
    for table in tables:
        by_dtype.setdefault(table.dtype, []).append(table)
    for members in by_dtype.values():
        _sum_together(members)


def _sum_together(tables: Sequence[SummedOwnTable]) -> None:
    first = tables[0]
    device = first.param.device
    flags = torch.tensor([t._caught is not None for t in tables], dtype=first.dtype,
                         device=device)
    payload = torch.cat([flags, *[(t._caught if t._caught is not None
                                   else torch.zeros_like(t.param)).reshape(-1)
                                  for t in tables]])
    all_to_all = reduction.by_all_to_all(payload, first.group)
    reduction.account_payloads([(t.name, t.param.numel() * t.param.element_size())
                                for t in tables], traffic=first.traffic, all_to_all=all_to_all)
    reduction.all_reduce(payload, group=first.group, all_to_all=all_to_all)
    reached = payload[:len(tables)].tolist()
    grads = payload[len(tables):].split([t.param.numel() for t in tables])
    world = first.worker.world_size
    for table, anyone, grad in zip(tables, reached, grads, strict=True):
        table._caught = None
        if not anyone:
            continue  # no worker's backward reached it: its .grad stays as it is
        grad = grad.view_as(table.param)
        if table.average:
            grad = grad / world
        param = table.param
        param.grad = grad if param.grad is None else param.grad + grad
