"""Server-held tables that travel as one in a step's exchange: a *table group*.

Tables of one pull that are alike in every way the exchange and the servers' arithmetic see
(one dtype, row shape and device; rows partitioned alike, each server holding at most one
partition of each; dense gradients; no option that depends on the batch; no leader hop; one
item of the early push's schedule, which sends apart tables whose gradients arrive apart) are
exchanged as one table of their rows end to end: member ``m``'s id ``i`` is the group's id
``offsets[m] + i``. The group's ids are deduplicated, sorted by owner and sent once, its rows
served by one gather and its gradient rows summed by one ``index_add_``, whatever the number
of members; each member keeps its own count message entry (its bad ids are named as its own,
its bytes counted as its own), its own leaf rows (its ``.grad`` is None when no backward
reached it, as on one device) and its touched rows.

Offsets are multiples of the partition count, so a group id has the partition (and the owner)
of the member's id. On a server the members' shards are views of one *store* (their rows end
to end, ``store``), and their dense gradients views of its gradient: the member's
``nn.Parameter`` stays the one the servers' optimizer holds, only its storage moves. The store
is made at the first pull that finds the members' shards elsewhere (a repartition, a checkpoint
that swapped a shard) and the group dissolves whenever a member stops being alike (the cache
key of `groups_of` then differs).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from parallax.cluster import WorkerInfo
from parallax.engine.tables.exchange import Traffic
from parallax.engine.tables.partitioning import RowPartitioning
from parallax.engine.tables.reservations import Reservations
from parallax.engine.tables.sharding import ROWS, Sharding
from parallax.errors import InternalError

__all__ = ["GroupedTable", "TableGroup", "group_key", "groups_of"]

#: sets of tables whose units a run keeps (the forward's prefetch, a pull of dense tables
#: pulled whole, ...): more are made again when next pulled
CACHED_PULLS = 4

#: a group's name begins so: it is an exchange's key, never a parameter's name
GROUP_PREFIX = "table group "


class GroupedTable(Protocol):
    """What a group needs of a member (`parallax.engine.tables.server_table.ShardedTable`)."""

    name: str
    num_rows: int
    row_shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    worker: WorkerInfo
    group: Any
    traffic: Traffic
    partitioning: RowPartitioning
    sharding: Sharding
    sparse_grad: bool
    average: bool
    divides_rows_on_arrival: bool
    local_aggregation: bool
    batch_dependent: Any
    shard: nn.Parameter | None
    before_read: Callable[[Tensor | None], None] | None
    steps: Any
    store_group: object | None

    def note_touched(self, rows: Tensor) -> None: ...


def group_key(table: Any) -> tuple[object, ...] | None:
    """What ``table`` must share with the other members of its group, or None where it
    travels alone. Every rank answers alike (nothing here is a server's own)."""
    if getattr(table, "exchanged_as_rows", False) is not True:
        return None
    partitioning = table.partitioning
    if (table.sharding is not ROWS or table.sparse_grad or table.batch_dependent is not None
            or table.local_aggregation
            or partitioning.num_partitions > len(partitioning.server_ranks)):
        return None
    return (table.dtype, table.row_shape, table.device, partitioning.num_partitions,
            partitioning.first_server, partitioning.server_ranks, table.divides_rows_on_arrival,
            id(table.group), id(table.traffic), id(table.steps),
            table.steps.push_items.get(table.name))


def groups_of(tables: Sequence[Any], cache: dict[Any, list[Any]]) -> list[Any]:
    """The units of one pull of ``tables``: a `TableGroup` for each set of two or more alike
    tables (`group_key`), in place of its first member, and every other table itself.
    ``cache`` (the run's) keeps the units per set of tables and partitionings, so a group
    lives as long as its members stay alike; a table is in one group's store at a time, so a
    new set of tables drops the sets it shares a table with (their groups' stores go with
    them), and the layout drops them all when its tables change."""
    # (the objects themselves, not their ids: the key keeps them alive, so no new table or
    # partitioning can take an old one's id and its group)
    key = tuple([(t, t.partitioning, t.sharding, t.local_aggregation) for t in tables])
    units = cache.get(key)
    if units is None:
        units = _units(tables)
        # a table is in one store at a time: sets sharing a table with this one go (and with
        # them a dissolved group's store); so do the oldest beyond `CACHED_PULLS`
        mine = {id(t) for t in tables}
        for stale in [k for k in cache if any([id(entry[0]) in mine for entry in k])]:
            del cache[stale]
        if len(cache) >= CACHED_PULLS:
            del cache[next(iter(cache))]
        cache[key] = units
    return units


def _units(tables: Sequence[Any]) -> list[Any]:
    """`groups_of`'s units, made anew."""
    by_key: dict[tuple[object, ...], list[Any]] = {}
    for table in tables:
        alike = group_key(table)
        if alike is not None:
            by_key.setdefault(alike, []).append(table)
    grouped = {id(t): members for members in by_key.values() if len(members) > 1
               for t in members}
    units, seen = [], set()
    for table in tables:
        members = grouped.get(id(table))
        if members is None:
            units.append(table)
        elif id(members[0]) not in seen:
            seen.add(id(members[0]))
            units.append(TableGroup(members))
    return units


class TableGroup:
    """Alike server-held tables exchanged as one (see the module): the exchange's view of
    them as one table, and on a server the store of their rows."""

    one_partition = True  # (a server holds at most one partition of each member)

    def __init__(self, members: Sequence[GroupedTable]) -> None:
        first = members[0]
        self.members = list(members)
        self.member_names = [m.name for m in members]
        self.member_index = {name: k for k, name in enumerate(self.member_names)}
        self.name = GROUP_PREFIX + "+".join(self.member_names)
        partitions = first.partitioning.num_partitions
        # each member's first group id: a multiple of the partition count
        self.offsets, at = [], 0
        for member in members:
            self.offsets.append(at)
            at += -(-member.num_rows // partitions) * partitions
        self.num_rows = at
        self.row_shape, self.dtype, self.device = first.row_shape, first.dtype, first.device
        self.worker, self.group, self.traffic = first.worker, first.group, first.traffic
        self.steps, self.divides_rows_on_arrival = first.steps, first.divides_rows_on_arrival
        self.partitioning = RowPartitioning(self.num_rows, partitions,
                                            first.partitioning.server_ranks,
                                            first.partitioning.first_server)
        self.reservations = Reservations(first.worker.world_size)
        self.shard: Tensor | None = None  # the store, on a server
        self._shards: list[nn.Parameter | None] = []
        self._pointers: list[int] = []
        self._grad: Tensor | None = None
        self._grads: list[Tensor | None] = []
        # the members' first group ids but the first's (made once: on a GPU each copy from
        # the host is a wait)
        self._member_bounds = torch.tensor(self.offsets[1:], dtype=torch.long,
                                           device=self.device)
        self._delta: Tensor | None = None   # store row - group id // P, per member
        self._starts: list[int] = []
        self._received: list[tuple[Tensor, bool]] = []
        self._store_bounds: Tensor | None = None   # the members' first store rows (a server's)
        # per-row optimizer state as stores (`state_store`): the store, the members' views
        self._states: dict[str, tuple[Tensor, list[Tensor]]] = {}

    def empty_rows(self, count: int) -> Tensor:
        return torch.empty((count, *self.row_shape), dtype=self.dtype, device=self.device)

    def group_ids(self, uniques: Sequence[Tensor]) -> Tensor:
        """The group's sorted unique ids of the members' sorted unique ``uniques``."""
        return torch.cat([u if offset == 0 else u + offset
                          for u, offset in zip(uniques, self.offsets, strict=True)])

    def counts_by_member(self, ids: Tensor, owner: Tensor) -> Tensor:
        """How many of the group ``ids`` (sorted) each member sends each rank (``owner``: each
        id's), as one vector ``[member * world + rank]``."""
        world = self.worker.world_size
        member = torch.bucketize(ids, self._member_bounds, right=True)
        return torch.bincount(member * world + owner, minlength=len(self.members) * world)

    # ---- at a server ------------------------------------------------------------------
    def _store(self) -> Tensor | None:
        """The store (None off the servers), made again where a member's shard moved."""
        shards = [m.shard for m in self.members]
        if shards[0] is None:
            return None
        if self._holds(shards):
            return self.shard
        return self._make_store(shards)

    def _holds(self, shards: Sequence[Tensor | None]) -> bool:
        """Whether the members' ``shards`` (in member order) are the store's views still.
        (Builtins over the members, not generators: asked at every pull and update.)"""
        return (self.shard is not None and all(map(operator.is_, shards, self._shards))
                and [0 if s is None else s.data_ptr() for s in shards] == self._pointers)

    def _grads_held(self, grads: Sequence[Tensor | None]) -> bool:
        """Whether the members' dense ``grads`` (in member order) are the store gradient's
        views still."""
        return self._grad is not None and all(map(operator.is_, grads, self._grads))

    def _make_store(self, shards: list[nn.Parameter | None]) -> Tensor:
        sizes = [0 if s is None else s.shape[0] for s in shards]
        store = self.empty_rows(sum(sizes))
        starts, at = [], 0
        for shard, size in zip(shards, sizes, strict=True):
            starts.append(at)
            if shard is not None and size:
                store[at:at + size].copy_(shard.data)
            at += size
        for shard, start, size in zip(shards, starts, sizes, strict=True):
            if shard is not None:
                shard.data = store[start:start + size]  # (its old storage goes)
        for member in self.members:  # (where the servers' update finds the store)
            member.store_group = self
        self.shard, self._shards, self._starts = store, list(shards), starts
        self._pointers = [0 if s is None else s.data_ptr() for s in shards]
        partitions = self.partitioning.num_partitions
        self._delta = torch.tensor([start - offset // partitions for start, offset
                                    in zip(starts, self.offsets, strict=True)],
                                   dtype=torch.long, device=self.device)
        self._store_bounds = torch.tensor(starts[1:], dtype=torch.long, device=self.device)
        self._grad, self._grads = None, []
        self._states = {}
        return store

    def store_starts(self) -> list[int]:
        """Each member's first row in the store (a server's)."""
        return self._starts

    def store_and_gradient(self, shards: Sequence[Tensor], grads: Sequence[Tensor],
                           ) -> tuple[Tensor | None, Tensor | None]:
        """The store and its gradient, where the members' ``shards`` and dense ``grads``
        (in member order) are still views of them; else ``(None, None)``. (Builtins over the
        members, not generators: the servers ask every step.)"""
        if not (self._holds(shards) and self._grads_held(grads)):
            return None, None
        return self.shard, self._grad

    def state_store(self, key: str, tensors: Sequence[Tensor | None]) -> Tensor | None:
        """The members' per-row optimizer state ``key`` as one tensor of the store's rows
        (made, and the members' ``tensors`` copied in, where they are not its views yet;
        `state_views` are what the members' state must hold then). None where a tensor is
        not one member's rows."""
        held = self._states.get(key)
        if held is not None and all(map(operator.is_, tensors, held[1])):
            return held[0]
        store = self.shard
        if store is None or not all([
                t is not None and t.shape[0] == stop - start and t.shape[1:] == store.shape[1:]
                and t.dtype == store.dtype and t.device == store.device
                for t, (_, start, stop) in zip(tensors, self._member_slices(), strict=True)]):
            return None
        joined = torch.cat(list(tensors))  # type: ignore[arg-type]
        views = [joined[start:stop] for _, start, stop in self._member_slices()]
        self._states[key] = (joined, views)
        return joined

    def state_views(self, key: str) -> list[Tensor]:
        """Each member's view of the state store ``key`` (`state_store`)."""
        return self._states[key][1]

    def serve(self, ids: Tensor, *, lookup: bool, source: Tensor | None,
              ) -> tuple[Tensor, Tensor]:
        """At a server: the store rows of the group ``ids`` it received, and their values
        (every member's deferred steps applied to its rows first). Lookups only: a read of
        a member's rows (an export, a move) asks the member."""
        if source is not None or not lookup:
            raise InternalError(f"'{self.name}': a group serves lookups only; please report it")
        store = self._store()
        if store is None:
            return ids, self.empty_rows(0)
        local = self.shard_rows_of(ids)
        for member, start, stop in self._member_slices():
            if member.before_read is not None:
                mine = (local >= start) & (local < stop)
                member.before_read(local[mine] - start)
        return local, store.index_select(0, local)

    def _member_slices(self) -> list[tuple[GroupedTable, int, int]]:
        ends = [*self._starts[1:], 0 if self.shard is None else self.shard.shape[0]]
        return list(zip(self.members, self._starts, ends, strict=True))

    def shard_rows_of(self, ids: Tensor) -> Tensor:
        """The store rows of group ``ids`` this server owns."""
        if self._delta is None:
            raise InternalError(f"'{self.name}': rows asked before the store; please report it")
        member = torch.bucketize(ids, self._member_bounds, right=True)
        partitions = self.partitioning.num_partitions
        quotient = ids if partitions == 1 else ids // partitions
        return quotient + self._delta.index_select(0, member)

    def accumulate(self, local_rows: Tensor, grad_rows: Tensor, sorted_distinct: bool) -> None:
        """At a server: add one sender's gradient rows at store rows ``local_rows``."""
        grad = self._gradient()
        grad.index_add_(0, local_rows, grad_rows)
        self._received.append((local_rows, sorted_distinct))

    def _gradient(self) -> Tensor:
        """The store's dense gradient, the members' gradients viewing it (made again where a
        member's gradient is another tensor: its values are kept)."""
        store = self._store()
        if store is None:
            raise InternalError(f"'{self.name}': a gradient asked off the servers; please "
                                f"report it")
        shards = self._shards
        if self._grad is not None and self._grads_held(
                [None if s is None else s.grad for s in shards]):
            return self._grad
        grad = torch.zeros_like(store)
        for shard, (_, start, stop) in zip(shards, self._member_slices(), strict=True):
            if shard is None:
                continue
            if shard.grad is not None:
                grad[start:stop].copy_(shard.grad)
            shard.grad = grad[start:stop]
        self._grad, self._grads = grad, [None if s is None else s.grad for s in shards]
        return grad

    def finish_aggregation(self) -> None:
        """The end of a push at a server: each member told which of its rows received
        gradient."""
        received, self._received = self._received, []
        if not received:
            return
        if len(received) == 1 and received[0][1]:
            rows = received[0][0]
        else:
            rows = torch.unique(torch.cat([rows for rows, _ in received]))
        if self._store_bounds is None:
            raise InternalError(f"'{self.name}': gradient rows before the store; please "
                                f"report it")
        cuts = [0, *torch.searchsorted(rows, self._store_bounds).tolist(), rows.numel()]
        for k, (member, start, _) in enumerate(self._member_slices()):
            mine = rows[cuts[k]:cuts[k + 1]]
            if mine.numel():
                member.note_touched(mine if start == 0 else mine - start)
