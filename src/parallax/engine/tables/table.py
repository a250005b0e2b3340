"""The table contract: what the runner, the stand-in layers and checkpoints need of whatever
holds a sparse parameter (or, under ps/optps, a dense one pulled whole).

Two kinds implement it: `parallax.engine.tables.server_table.ShardedTable` (rows partitioned over
the parameter servers, pulled and pushed every step) and
`parallax.engine.tables.replicated.ReplicatedTable` (a replica on every worker, gradient rows
exchanged by AllGatherv or AllReduced). Callers ask a table what it is (``on_servers``, ``shard``,
``replica``) instead of testing its class, so a third kind is one new file.

A step drives a table through fixed phases: ``lookup`` (in the forward) → ``push_gradients``
(after the backward; `push_all` lets a kind batch all its tables into one exchange) →
``grad_norm_squared``/``scale_grad`` (finiteness check, clipping) → the update, which the shard
optimizer applies to ``shard`` or the user's optimizer to ``replica``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from parallax.engine.tables.bag_use import BagUse
from parallax.engine.tables.riders import Rider
from parallax.engine.tables.sharding import Sharding
from parallax.engine.tables.verdict import Verdict

if TYPE_CHECKING:
    from parallax.engine.tables.pool import PartitionPool
    from parallax.engine.tables.server_table import ShardedTable

__all__ = ["Table", "held_tables", "push_all"]


@runtime_checkable
class Table(Protocol):
    """Whatever holds one parameter's rows for the runner (collective: every rank calls it)."""

    name: str
    num_rows: int
    row_shape: tuple[int, ...]
    #: ``"ps"`` (server-held), ``"allgatherv"`` or ``"allreduce"`` (replicated): the plan's word
    sync: str
    #: rows partitioned over the servers (pulled and pushed), rather than replicated
    on_servers: bool
    #: its gradients travel at the step's push (False: the program's own parameter, whose
    #: gradient autograd wrote whole, with nothing to exchange)
    exchanges: bool
    rows_used: list[int]  # per training step, the rows this worker read (α's measurement)
    machine_rows_used: list[int]
    bag_use: BagUse  # its nn.EmbeddingBag calls' ids and bags over those steps
    #: whether those are counted: until α is measured (`PlanKeeper` turns it off, so that a
    #: long run neither pays for counting nor keeps a list that grows every step)
    measuring: bool
    dtype: torch.dtype
    #: lookups with dense-gradient (False) or sparse-gradient (True) semantics
    sparse_grad: bool
    #: whether this table's exchanges go through each machine's leader
    local_aggregation: bool
    #: the threads its per-partition work runs on
    pool: PartitionPool
    #: how its rows are held and read (`parallax.engine.tables.sharding`): with
    #: ``sharding.pools``, ``nn.EmbeddingBag`` calls are pooled where the rows live
    #: (`pool_bags`, `parallax.engine.tables.pooled`) instead of pulling the rows (`lookup`)
    sharding: Sharding

    @property
    def shard(self) -> nn.Parameter | None:
        """The rows this process updates with the shard optimizer (None: not a server of it)."""

    @property
    def replica(self) -> nn.Parameter | None:
        """The full parameter the user's optimizer updates on every worker (replicated kinds)."""

    @property
    def held(self) -> ShardedTable | None:
        """The server-held table whose ``shard`` the servers' optimizer and its state work on
        (itself, or the synchronous table an asynchronous one wraps); None for a replicated
        kind. What needs the servers' rows asks this instead of testing the class."""

    def lookup(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """``(rows of the unique ids, inverse)`` with ``rows[inverse]`` the rows of ``ids``."""

    def pool_bags(self, ids: Tensor, offsets: Tensor | None, per_sample_weights: Tensor | None, *,
                  mode: str, padding_idx: int | None, include_last_offset: bool) -> Tensor:
        """``F.embedding_bag`` of this table computed where it lives (a sharding that
        pools)."""

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def push_gradients(self) -> None:
        """Send this step's gradient rows to where they are aggregated."""

    def grad_norm_squared(self) -> Tensor:
        """This process's part of the aggregated gradient's squared L2 norm (float64)."""

    def scale_grad(self, factor: Tensor) -> None: ...

    def clamp_grad(self, value: float) -> None:
        """Clamp the aggregated gradient this process holds to ``[-value, value]`` element by
        element (``clip_grad_value_``)."""

    def full_weight(self, source: Tensor | None = None) -> Tensor:
        """The whole parameter (or per-row ``source``, e.g. optimizer state), on every rank
        (collective)."""

    def assign(self, weight: Tensor) -> None:
        """Set the whole parameter's values (every rank passes the same ``weight``)."""

    @staticmethod
    def push_together(tables: Sequence[Any], verdict: Verdict | None = None,
                      riders: Sequence[Rider] = ()) -> None:
        """Push all ``tables`` of this kind (in one exchange where the kind can); a kind
        that can carries the step's ``verdict`` (`parallax.engine.tables.verdict`) and the
        ``riders`` (`parallax.engine.tables.riders`)."""


def held_tables(tables: Mapping[str, Table]) -> dict[str, ShardedTable]:
    """The server-held tables behind ``tables`` (`Table.held`), by the same names: what the
    servers' optimizer, their rows and their exchanges work on."""
    return {name: held for name, table in tables.items() if (held := table.held) is not None}


def push_all(tables: Iterable[Table], verdict: Verdict | None = None,
             riders: Sequence[Rider] = ()) -> None:
    """Push every table's gradients: each kind pushes its tables together (collective; every
    rank holds the same tables in the same order, so the kinds go in the same order); the
    step's ``verdict`` and ``riders`` ride with the server-held tables' push
    (`parallax.engine.tables.riders`: those no message took wait for `settle`)."""
    by_kind: dict[type[Table], list[Table]] = {}
    for table in tables:
        by_kind.setdefault(type(table), []).append(table)
    for kind, members in by_kind.items():
        kind.push_together(members, verdict, riders)
