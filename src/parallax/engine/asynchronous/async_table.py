"""Server-held parameters under asynchronous training: the worker's side.

`AsyncTable` implements the `parallax.engine.tables.table.Table` contract for a parameter whose rows
the asynchronous servers hold (`parallax.engine.asynchronous.async_server`): a lookup pulls the
rows from their owners by point-to-point messages (no collective: no other worker takes part), and
the push after the backward sends this worker's gradient rows to every server and waits for
their acknowledgements. Everything else — the shard, checkpoints, export, optimizer state —
is the wrapped `ShardedTable`'s, read while the servers are quiet (`AsyncTraining.quiet`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from parallax.engine.tables.bag_use import BagUse
from parallax.engine.tables.exchange import unique_ids
from parallax.engine.tables.riders import Rider
from parallax.engine.tables.row_exchange import rows_pulled_ahead
from parallax.engine.tables.server_table import ShardedTable
from parallax.engine.tables.sharding import ROWS, Sharding
from parallax.engine.tables.step_context import OwedRows, Prefetched, TableSteps
from parallax.engine.tables.verdict import Verdict
from parallax.errors import SparseIdError

__all__ = ["AsyncExchange", "AsyncTable"]


class AsyncExchange(Protocol):
    """What a table needs of the run's messages (`parallax.engine.asynchronous.async_training`)."""

    rank: int

    def pull(self, indices: Sequence[int], tables: Sequence[ShardedTable],
             uniques: Sequence[Tensor]) -> list[Tensor]: ...

    def push(self, tables: Sequence[AsyncTable]) -> None: ...


class AsyncTable:
    """One server-held parameter pulled and pushed asynchronously (see the module)."""

    sync = "ps"
    on_servers = True
    exchanges = True
    replica = None
    local_aggregation = False
    sharding: Sharding = ROWS  # (pooling is refused under an asynchronous sync)

    def __init__(self, inner: ShardedTable, index: int, run: AsyncExchange):
        self.inner = inner
        self.index = index  # position in every message's per-table counts
        self.run = run
        self.name = inner.name
        self.num_rows = inner.num_rows
        self.row_shape = inner.row_shape
        self.dtype = inner.dtype
        self.rows_used: list[int] = []
        self.machine_rows_used: list[int] = []
        self.bag_use = BagUse()
        # the run's step (the wrapped table's): this worker's rows read ahead and its lookups
        # owed live there (`parallax.engine.tables.step_context`)
        self.steps: TableSteps = inner.steps

    def __getattr__(self, name: str) -> Any:
        # the shard, partitioning, full_weight, assign, ...: the wrapped table's
        return getattr(self.inner, name)

    @property
    def shard(self) -> nn.Parameter | None:
        return self.inner.shard

    @property
    def held(self) -> ShardedTable:
        """The wrapped table: the servers' optimizer and its state work on it."""
        return self.inner

    # ---- forward -----------------------------------------------------------------------
    def lookup(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """``(rows of the unique ids, inverse)``: from this step's prefetched rows, else
        pulled now."""
        unique, inverse = self._unique(ids)
        held = self.steps.current.prefetched.get(self.name)
        if held is not None:
            return rows_pulled_ahead(held.ids, held.rows, unique, self.name,
                                     self.run.rank), inverse
        return pull_together([self], [unique])[0], inverse

    def _unique(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """Sorted unique ids and the inverse; an id outside the table fails this worker
        (the others do not take part in its pulls) with `SparseIdError`."""
        unique, inverse, bad_id = unique_ids(ids, self.num_rows, self.name, self.run.rank)
        if bad_id is not None:
            raise SparseIdError(
                f"parallax: sparse parameter '{self.name}' got id {bad_id} on rank "
                f"{self.run.rank}, outside its rows [0, {self.num_rows})")
        return unique, inverse

    @staticmethod
    def prefetch_together(tables: Sequence[AsyncTable], ids: Sequence[Sequence[Tensor]]) -> None:
        """Pull, in one request per server, the rows of all lookups a forward is about to
        make (``ids[i]``: the ids of every lookup of ``tables[i]``)."""
        uniques = [table._unique(torch.cat([i.reshape(-1).long() for i in table_ids])
                                 if table_ids else torch.empty(0, dtype=torch.long))[0]
                   for table, table_ids in zip(tables, ids, strict=True)]
        for table, unique, rows in zip(tables, uniques, pull_together(tables, uniques),
                                       strict=True):
            table.steps.current.prefetched[table.name] = Prefetched(unique, rows)

    def forget_prefetched(self) -> None:
        """The forward that read rows ahead has ended: the next one pulls its own."""
        self.steps.forward_done([self.name])

    # ---- backward ----------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        for lookup in self.steps.owed(self.name):
            lookup.rows.grad = None
        self.steps.forward_done([self.name])

    @staticmethod
    def push_together(tables: Sequence[AsyncTable], verdict: Verdict | None = None,
                      riders: Sequence[Rider] = ()) -> None:
        """This step's gradient rows of every table, to every server (one push each); no
        verdict rides (asynchronous servers apply each push as it comes)."""
        if tables:
            tables[0].run.push(tables)

    def push_gradients(self) -> None:
        self.run.push([self])

    def gradient_rows(self) -> tuple[Tensor, Tensor]:
        """This step's ``(ids, gradient rows)`` (ids may repeat across lookups; zeros where
        a backward gave none), and the step's pulls forgotten."""
        pending = self.steps.take_owed(self.name)
        if not pending:
            return torch.empty(0, dtype=torch.long), torch.empty((0, *self.row_shape),
                                                                 dtype=self.dtype)
        ids = torch.cat([lookup.ids for lookup in pending])
        self.rows_used.append(int(torch.unique(ids).numel()))
        grads = torch.cat([rows.grad if rows.grad is not None else torch.zeros_like(rows)
                           for _, rows, _ in pending])
        return ids, grads.detach()

    def grad_norm_squared(self) -> Tensor:
        """The squared norm of this worker's own gradient rows, the push it is about to
        make (asynchronous servers aggregate nothing: clipping is per push)."""
        squared = torch.zeros((), dtype=torch.float64)
        for _, rows, _ in self.steps.owed(self.name):
            if rows.grad is not None:
                squared += torch.linalg.vector_norm(rows.grad, dtype=torch.float64) ** 2
        return squared

    def scale_grad(self, factor: Tensor) -> None:
        """Multiply this worker's own gradient rows (before the push) by ``factor``."""
        for _, rows, _ in self.steps.owed(self.name):
            if rows.grad is not None:
                rows.grad.mul_(factor.to(rows.grad.dtype))

    def clamp_grad(self, value: float) -> None:
        """Clamp this worker's own gradient rows (before the push) to ``[-value, value]``."""
        for _, rows, _ in self.steps.owed(self.name):
            if rows.grad is not None:
                rows.grad.clamp_(-value, value)

    def own_nonfinite(self) -> bool:
        """Whether this worker's own gradient rows hold a NaN or an infinity."""
        return any(rows.grad is not None and not bool(torch.isfinite(rows.grad).all())
                   for _, rows, _ in self.steps.owed(self.name))


def pull_together(tables: Sequence[AsyncTable], uniques: Sequence[Tensor]) -> list[Tensor]:
    """Rows of the sorted unique ``uniques[i]`` of ``tables[i]``, one request per server that
    owns any; leaves that record their gradient for the push when autograd is on."""
    run = tables[0].run
    rows = run.pull([t.index for t in tables], [t.inner for t in tables], uniques)
    if torch.is_grad_enabled():
        for table, unique, leaf in zip(tables, uniques, rows, strict=True):
            leaf.requires_grad_(True)
            table.steps.owe(table.name, OwedRows(unique, leaf))
    return rows

