"""The exchange of the server-held tables' rows: the pull (and the prefetch, for all of a
forward's lookups at once), and the push of their gradient rows back to the servers.

Every call here is collective, over the `parallax.engine.tables.exchange.Hop` s it opens; what a
step pulled and owes between its calls lives in the run's step context
(`parallax.engine.tables.step_context`), never on a table; the rows and the arithmetic on
them are the table's (`parallax.engine.tables.server_table.ExchangedTable`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import Tensor, nn

from parallax.engine.diagnostics import phases
from parallax.engine.tables import lookup_options, pooled
from parallax.engine.tables.exchange import Hop, flat_long, read_back
from parallax.engine.tables.id_dedup import IdRequests
from parallax.engine.tables.lookup_options import BatchDependent
from parallax.engine.tables.reservations import Reservations, open_carrying
from parallax.engine.tables.riders import Rider, alight, board
from parallax.engine.tables.step_context import (
    Lookup,
    Prefetched,
    Pull,
    shared_steps,
    version_of,
)
from parallax.engine.tables.table_group import TableGroup, groups_of
from parallax.engine.tables.verdict import Verdict, bound_of
from parallax.errors import InternalError

__all__ = ["ExchangedTable", "can_push_early", "pending_pulls", "prefetch", "pull",
           "push_gradients", "read_rows_direct", "rows_pulled_ahead", "start_push"]


class ExchangedTable(pooled.PoolingTable, Protocol):
    """What the exchange needs of a server-held table: its rows' place and shape, and the
    server's sums of what it receives
    (`parallax.engine.tables.server_table.ExchangedTable` is one)."""

    row_shape: tuple[int, ...]
    local_aggregation: bool
    divides_rows_on_arrival: bool
    id_requests: IdRequests
    reservations: Reservations
    shard: nn.Parameter | None
    batch_dependent: BatchDependent | None
    before_read: Callable[[Tensor | None], None] | None

    @property
    def leader(self) -> int: ...

    @property
    def one_partition(self) -> bool: ...

    @property
    def scales_by_freq(self) -> bool: ...

    @property
    def holds_gradient_rows(self) -> bool: ...

    def shard_rows_of(self, ids: Tensor) -> Tensor: ...

    def serve(self, ids: Tensor, *, lookup: bool, source: Tensor | None,
              ) -> tuple[Tensor, Tensor]: ...

    def record_usage(self, pulls: Sequence[Pull]) -> None: ...

    def receive_counts(self, local_rows: Tensor, counts: Tensor) -> None: ...

    def accumulate(self, local_rows: Tensor, grad_rows: Tensor,
                   touched: Tensor | None = None, sorted_distinct: bool = False) -> None: ...

    def finish_aggregation(self) -> None: ...


def rows_pulled_ahead(held: Tensor, rows: Tensor, unique: Tensor, name: str, rank: int, *,
                      bad_id: int | None = None) -> Tensor:
    """The rows of the sorted ``unique`` ids among a step's prefetched ``held`` ids and their
    ``rows`` (every lookup's ids were pulled ahead, and the pull refused out-of-range ones:
    anything else is a bug of ours)."""
    position = torch.searchsorted(held, unique)
    if bad_id is not None or unique.numel() and (held.numel() == 0 or not torch.equal(
            held[position.clamp_max(held.numel() - 1)], unique)):
        raise InternalError(
            f"parallax internal error: rank {rank} looked up ids of '{name}' that were not "
            f"pulled ahead for this step; please report it")
    return rows[position]


def pull(tables: Sequence[ExchangedTable], ids: Sequence[Tensor]) -> list[tuple[Tensor, Tensor]]:
    """Rows of ``ids[i]`` from ``tables[i]`` (distinct tables of one runner), all in one
    exchange; ``(rows, inverse)`` per table as `ExchangedTable.lookup` returns them."""
    return [(rows, inverse) for rows, inverse, _ in _timed_pull(tables, ids)]


def _timed_pull(tables: Sequence[ExchangedTable], ids: Sequence[Tensor],
                ) -> list[tuple[Tensor, Tensor, Tensor]]:
    with phases.phase("pull"):
        return _pull(tables, ids)


def _pull(tables: Sequence[ExchangedTable], ids: Sequence[Tensor],
          ) -> list[tuple[Tensor, Tensor, Tensor]]:
    """`pull`'s ``(rows, inverse)`` per table, and the sorted unique ids the rows are of."""
    first = tables[0]
    steps = shared_steps(tables)
    requests = first.id_requests.requests(ids, [t.num_rows for t in tables],
                                          [t.name for t in tables], first.worker.rank)
    uniques = {t.name: unique for t, (unique, _, _) in zip(tables, requests, strict=True)}
    bad_ids = {t.name: bad for t, (_, _, bad) in zip(tables, requests, strict=True)}
    to_leader = None
    units: dict[str, Lookup] = {}
    groups: dict[str, TableGroup] = {}
    if first.local_aggregation:
        counts = {}
        for table in tables:
            counts[table.name] = [0] * first.worker.world_size
            counts[table.name][table.leader] = uniques[table.name].numel()
        to_leader = _open(tables, counts, bad_ids)
        pieces = to_leader.forward_many(uniques)  # at a leader: every local worker's ids
        merged = {name: torch.unique(piece, return_inverse=True)
                  for name, piece in pieces.items()}
        merged_rows, direct, lookups, _, _ = _pull_direct(
            tables, {name: m for name, (m, _) in merged.items()}, dict.fromkeys(merged),
            lookup=True)
        rows = to_leader.backward_many({name: merged_rows[name].index_select(0, inverse)
                                        for name, (_, inverse) in merged.items()})
        for name, (ids_merged, inverse) in merged.items():
            lookups[name].merged_inverse = inverse
            lookups[name].merged_count = ids_merged.numel()
    else:
        exchanged = tables if len(tables) == 1 else groups_of(tables, steps.groups)
        rows, direct, lookups, units, groups = _pull_direct(
            exchanged, uniques, bad_ids, lookup=True, distinct=first.id_requests.distinct)
    for name, lookup in lookups.items():
        lookup.ids, lookup.rows = uniques[name], rows[name]
    for table, (unique, inverse, _) in zip(tables, requests, strict=True):
        if table.scales_by_freq:
            lookups[table.name].counts = torch.bincount(inverse.reshape(-1),
                                                        minlength=unique.numel())
    if torch.is_grad_enabled():
        for table in tables:
            lookups[table.name].rows.requires_grad_(True)
        steps.current.pulls.append(Pull(lookups, direct, to_leader, units=units,
                                        groups=groups))
    return [(rows[t.name], inverse, unique)
            for t, (unique, inverse, _) in zip(tables, requests, strict=True)]


def prefetch(tables: Sequence[ExchangedTable], ids: Sequence[Sequence[Tensor]]) -> None:
    """Pull, in one exchange, the rows of all lookups a forward is about to make: ``ids[i]``
    lists the ids of every lookup of ``tables[i]``; each lookup is then served locally."""
    # int64 whatever the lookups' dtypes (nn.Embedding takes int32 ids too)
    # (one lookup's ids as they are: the pull only reads them)
    unions = [(flat_long(table_ids[0]) if len(table_ids) == 1 else
               torch.cat([flat_long(i) for i in table_ids])) if table_ids
              else torch.empty(0, dtype=torch.long) for table_ids in ids]
    pulled = _timed_pull(tables, unions)
    prefetched = tables[0].steps.current.prefetched  # (one run's: `_pull` checked)
    for table, table_ids, (rows, inverse, unique) in zip(tables, ids, pulled, strict=True):
        # each lookup's, in order
        pieces = ((inverse,) if len(table_ids) == 1
                  else inverse.split_with_sizes([i.numel() for i in table_ids]))
        prefetched[table.name] = Prefetched(unique, rows, [
            (i, version_of(i), piece) for i, piece in zip(table_ids, pieces, strict=True)])


def _open(tables: Sequence[ExchangedTable], counts: dict[str, list[int]],
          bad_ids: dict[str, int | None]) -> Hop:
    first = tables[0]
    return Hop.open_many(counts, group=first.group, traffic=first.traffic,
                         num_rows={t.name: t.num_rows for t in tables}, bad_ids=bad_ids,
                         device=first.device)


def _pull_direct(units: Sequence[ExchangedTable | TableGroup], uniques: dict[str, Tensor],
                 bad_ids: dict[str, int | None], source: Tensor | None = None,
                 lookup: bool = False, distinct: bool = True,
                 ) -> tuple[dict[str, Tensor], Hop, dict[str, Lookup], dict[str, Lookup],
                            dict[str, TableGroup]]:
    """Rows ``uniques[name]`` (sorted, distinct) of each table from their owners' shards (or
    from ``source``, a tensor shaped like the shard, e.g. an optimizer state; one table
    only), the ``units`` of the exchange being tables and table groups
    (`parallax.engine.tables.table_group`). A ``lookup``'s pull (training or evaluation, not
    an export) sends its ids with the count message (`open_carrying`), and owners of a
    ``max_norm`` table first renormalise the requested rows in place, as ``F.embedding``
    does on one device: the requests of all workers together are the global batch's ids,
    and renormalising is idempotent, so the result is exact.

    ``distinct``: whether ``uniques`` are distinct (else each id as often as it was looked
    up: `Config.id_dedup` ``"servers"``).

    Returns the rows and the lookup per table, the hop, and where groups travelled, the
    lookup per unit and the groups."""
    world = units[0].worker.world_size
    groups = {unit.name: unit for unit in units if isinstance(unit, TableGroup)}
    ids = {unit.name: (uniques[unit.name] if unit.name not in groups else
                       groups[unit.name].group_ids([uniques[n] for n in
                                                    groups[unit.name].member_names]))
           for unit in units}
    orders: dict[str, Tensor | None] = {}
    counts: dict[str, list[int]] = {}
    members: dict[str, list[tuple[str, list[int]]]] = {}
    by_owner: dict[str, Tensor] = {}
    for unit in units:
        names = [unit.name] if unit.name not in groups else groups[unit.name].member_names
        single = unit.partitioning.single_owner
        if single is not None:  # one owner: its count is known here, the ids stay in order
            orders[unit.name] = None
            counts[unit.name] = [ids[unit.name].numel() if r == single else 0
                                 for r in range(world)]
            if unit.name in groups:
                members[unit.name] = [(n, [uniques[n].numel() if r == single else 0
                                           for r in range(world)]) for n in names]
            continue
        # (a bad id is refused on every rank once the count message is read: until then it
        # only needs an owner)
        bad = any(bad_ids.get(n) is not None for n in names)
        owner = unit.partitioning.owner_rank(
            ids[unit.name].clamp(0, max(unit.num_rows - 1, 0)) if bad else ids[unit.name])
        orders[unit.name] = torch.argsort(owner, stable=True)
        by_owner[unit.name] = (torch.bincount(owner, minlength=world) if unit.name not in groups
                               else groups[unit.name].counts_by_member(ids[unit.name], owner))
    read = dict(zip(by_owner, read_back(list(by_owner.values())), strict=True))
    for name, values in read.items():
        if name not in groups:
            counts[name] = values
            continue
        members[name] = [(n, values[m * world:(m + 1) * world])
                         for m, n in enumerate(groups[name].member_names)]
        counts[name] = [sum(c[peer] for _, c in members[name]) for peer in range(world)]
    counts = {u.name: counts[u.name] for u in units}  # the units' order: the message's
    sorted_ids = {u.name: _by_owner(ids[u.name], orders[u.name]) for u in units}
    num_rows = {u.name: u.num_rows for u in units}
    for group in groups.values():
        num_rows.update((m.name, m.num_rows) for m in group.members)
    first = units[0]
    if lookup:
        hop, recv_ids = open_carrying(
            sorted_ids, counts, reservations={u.name: u.reservations for u in units},
            group=first.group, traffic=first.traffic, num_rows=num_rows, bad_ids=bad_ids,
            members=members or None)
    else:
        if groups:
            raise InternalError("parallax internal error: a table group read outside a "
                                "lookup; please report it")
        hop = _open(units, counts, bad_ids)  # type: ignore[arg-type]
        recv_ids = hop.forward_many(sorted_ids)
    served, exchanged = {}, {}
    for unit in units:
        local, served[unit.name] = unit.serve(recv_ids[unit.name], lookup=lookup,
                                              source=source)
        senders = sum(1 for count in hop.recv_counts[unit.name] if count)
        exchanged[unit.name] = Lookup(recv_ids[unit.name], unit.empty_rows(0),
                                      orders[unit.name], local,
                                      local_sorted=(senders <= 1 and unit.one_partition
                                                    and distinct))
    back = hop.backward_many(served)
    rows: dict[str, Tensor] = {}
    lookups: dict[str, Lookup] = {}
    for unit in units:
        order, arrived = orders[unit.name], back[unit.name]
        if order is None:  # (arrived in the ids' order)
            if arrived.dtype != unit.dtype:
                raise InternalError(f"'{unit.name}': rows of {arrived.dtype} pulled "
                                    f"for a table of {unit.dtype}; please report it")
            pulled = arrived
        else:  # (back in the ids' order: one index_copy_, not indexing's Python machinery)
            pulled = unit.empty_rows(ids[unit.name].numel()).index_copy_(0, order, arrived)
        grouped = groups.get(unit.name)
        if grouped is None:
            rows[unit.name], lookups[unit.name] = pulled, exchanged[unit.name]
            continue
        # each member's rows: its part of the group's, in its ids' order
        empty = exchanged[unit.name].recv_local_rows[:0]
        for name, piece in zip(grouped.member_names, pulled.split_with_sizes(
                [uniques[n].numel() for n in grouped.member_names]), strict=True):
            rows[name], lookups[name] = piece, Lookup(uniques[name], piece, None, empty)
    return rows, hop, lookups, (exchanged if groups else {}), groups


def read_rows_direct(table: ExchangedTable, unique: Tensor, source: Tensor | None) -> Tensor:
    """The current values of ``table``'s rows ``unique`` (sorted, distinct), from its shards
    or from ``source``, a tensor each server holds shaped like its shard (collective; an
    export's or a migration's read, not a lookup: nothing is owed)."""
    return _pull_direct([table], {table.name: unique}, {table.name: None}, source)[0][table.name]


def _by_owner(values: Tensor, order: Tensor | None) -> Tensor:
    """``values`` (one per unique id) sorted by owner rank, as a pull's ``order`` says (None:
    already)."""
    return values if order is None else values.index_select(0, order)


def push_gradients(tables: Sequence[ExchangedTable], verdict: Verdict | None = None,
                   riders: Sequence[Rider] = ()) -> None:
    """Send the gradient rows of every pull of this step to their servers (collective, in pull
    order, one exchange per pull for all its tables, unless `start_push` sent some already);
    servers sum the rows of all workers and, by default, divide by the worker count.
    ``tables`` must hold every table of those pulls. The step's ``verdict``
    (`parallax.engine.tables.verdict`, prepared here) and the other ``riders`` travel in the
    first message sent here (`parallax.engine.tables.riders`)."""
    by_name = {table.name: table for table in tables}
    steps = tables[0].steps if tables else None
    records = pending_pulls(tables)
    for table in tables:
        table.record_usage(records)
    exchanges = pooled.pending_exchanges(tables)
    if verdict is not None and tables:
        _prepare_verdict(verdict, tables, records, exchanges)
    aboard = [*([verdict] if verdict is not None else []), *riders]
    pooled.push_pooled(exchanges, aboard)
    groups: dict[str, TableGroup] = {}
    for record in records:
        groups.update(record.groups)
        units = record.exchanged()
        rest = [key for key in units if key not in record.launched]
        if record.in_flight:
            if rest:  # the part `EarlyPush` left for here
                start_push(record, rest, aboard)
            for finish in record.in_flight:
                _deliver(record, alight(aboard, finish()), by_name)
            continue
        grads = _gradients_to_push(record, list(units))
        if record.to_leader is not None:
            hop, payloads = board(aboard, record.to_leader, grads)
            pieces = alight(aboard, hop.forward_many(payloads))
            for name, lookup in record.lookups.items():
                merged = pieces[name].new_zeros((lookup.merged_count, *pieces[name].shape[1:]))
                if lookup.merged_inverse is None:
                    raise InternalError(f"'{name}': a leader's push without its pull's merge")
                grads[name] = merged.index_add_(0, lookup.merged_inverse, pieces[name])
        hop, payloads = board(aboard, record.direct, {
            key: _by_owner(grads[key], lookup.order) for key, lookup in units.items()})
        _deliver(record, alight(aboard, hop.forward_many(payloads)), by_name)
    if steps is not None:
        steps.pushed(records, exchanges)
    with phases.phase("server aggregation"):
        for group in groups.values():
            group.finish_aggregation()
        for table in tables:
            table.finish_aggregation()


def _prepare_verdict(verdict: Verdict, tables: Sequence[ExchangedTable], records: list[Pull],
                     exchanges: list[pooled.PooledExchange]) -> None:
    """This rank's verdict (before the push's first message): the tables a backward reached,
    the shards holding gradient from before, and a bound on what this rank adds to any
    aggregated element (each pull's rows are distinct: one row per element and message)."""
    first = tables[0]
    rows = bound_of(first.id_requests.bound_rows(
        [lookup.rows.grad for record in records for lookup in record.lookups.values()
         if lookup.rows.grad is not None]), first.device)
    verdict.prepare(
        names=[table.name for table in tables],
        reached=[table.has_gradient for table in tables],
        stale=sum(table.holds_gradient_rows for table in tables),
        # (on the exchange's device: the verdict travels in its messages)
        bound=rows.to(first.device) + pooled.bound_of_exchanges(exchanges, first.device),
        limit=min(torch.finfo(table.dtype).max for table in tables) / 2,
        world=first.worker.world_size)


def pending_pulls(tables: Sequence[ExchangedTable]) -> list[Pull]:
    """This step's pulls not yet pushed that hold rows of ``tables``, in the order
    `push_gradients` takes them (pull order: the same on every rank)."""
    if not tables:
        return []
    found, steps = [], tables[0].steps
    for table in tables:  # (`shared_steps`, inline: every push asks)
        if table.steps is not steps:
            raise InternalError("parallax internal error: tables of one push belong to "
                                "different runs' steps; please report it")
    for pull in steps.current.pulls:  # (loops: every push asks)
        for table in tables:
            if table.name in pull.lookups:
                found.append(pull)
                break
    return found


def can_push_early(record: Pull) -> bool:
    """Whether `start_push` may send ``record``'s gradients: not through a machine's leader
    (that hop merges rows of several workers before the direct exchange can start)."""
    return record.to_leader is None


def start_push(record: Pull, units: Sequence[str], riders: Sequence[Rider] = ()) -> None:
    """Issue now, without waiting, the exchange of the gradient rows that ``record`` holds
    for its ``units`` (tables, or table groups: `Pull.exchanged`; their backward must be
    complete); `push_gradients` waits for it and hands the rows to the servers. Every rank
    must start the same units of the same pulls in the same order (collective).
    ``riders``: those still waiting ride along."""
    if not can_push_early(record):
        raise InternalError("parallax internal error: an early push through the leader hop")
    units = list(units)
    exchanged = record.exchanged()
    grads = _gradients_to_push(record, units)
    hop = record.direct if len(units) == len(exchanged) else record.direct.subset(units)
    hop, payloads = board(riders, hop, {
        key: _by_owner(grads[key], exchanged[key].order) for key in units})
    record.in_flight.append(hop.start_forward_many(payloads))
    record.launched.extend(units)


def _gradients_to_push(record: Pull, units: Sequence[str]) -> dict[str, Tensor]:
    """The gradient rows of ``units`` in ``record`` (zeros where backward gave none), with
    their lookup counts as one more column under ``scale_grad_by_freq``; a table group's
    are its members' end to end."""
    grads = {}
    for key in units:
        group = record.groups.get(key)
        if group is None:
            grads[key] = _gradient_of(record.lookups[key])
        else:
            grads[key] = torch.cat([_gradient_of(record.lookups[name])
                                    for name in group.member_names])
    return grads


def _gradient_of(lookup: Lookup) -> Tensor:
    grad = lookup.rows.grad
    rows = torch.zeros_like(lookup.rows) if grad is None else grad
    if lookup.counts is not None:  # counts travel as one more column of the rows
        return lookup_options.with_counts(rows, lookup.counts)
    return rows


def _deliver(record: Pull, received: dict[str, Tensor],
             by_name: dict[str, ExchangedTable]) -> None:
    """At the servers: add the gradient rows received for ``record``'s units."""
    exchanged = record.exchanged()
    for key, values in received.items():
        lookup = exchanged[key]
        group = record.groups.get(key)
        if group is not None:
            if group.shard is not None:
                if group.divides_rows_on_arrival:
                    values.div_(group.worker.world_size)
                group.accumulate(lookup.recv_local_rows, values, lookup.local_sorted)
            continue
        table = by_name[key]
        if table.shard is None:
            continue
        if table.scales_by_freq:
            values, counts = lookup_options.split_counts(values, table.row_shape)
            table.receive_counts(lookup.recv_local_rows, counts)
        if table.divides_rows_on_arrival:
            values.div_(table.worker.world_size)
        table.accumulate(lookup.recv_local_rows, values, sorted_distinct=lookup.local_sorted)
