"""Where the element-wise operations on a server-held table's aggregated gradient run
(`Config.after_aggregation`: seed 001's operation placement after aggregation, +OPAU).

Between a step's aggregation and its update, one device applies element-wise operations to the
gradient: the average over the global batch's workers, a clip's scale. Here the aggregate is
made on the servers, so those operations can run there (`OnServers`, the default: nothing
travels; the average is taken as each worker's rows arrive) or where a placement that knows
only that they are not parameter updates would put them, on the workers (`OnWorkers`, the
ablation's baseline): each server sends its aggregated rows to every worker, every worker
applies the operation (as every replica of a graph copied per worker would), and the server
takes the result of one of them, the next rank's, back for its update. The values are those of
the same operations on the same aggregate (the average after the sum rather than per arriving
row: the same up to rounding); what differs is the traffic, counted as each table's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import Tensor

from parallax.engine.tables.exchange import Hop
from parallax.engine.tables.server_table import ShardedTable
from parallax.engine.tables.table import Table
from parallax.engine.tables.verdict import Verdict
from parallax.errors import UnsupportedProgramError

__all__ = ["AFTER_AGGREGATION", "AfterAggregation", "OnServers", "OnWorkers"]


class AfterAggregation(Protocol):
    """Where the operations after aggregation run (collective: every rank calls each method
    with the same tables in the same order)."""

    def average(self, tables: Sequence[Table], verdict: Verdict) -> None:
        """The server-held aggregates of ``tables`` (those the step pushed) divided by the
        workers where their servers did not divide the rows as they arrived (the push done,
        its ``verdict`` riding in it where any table was on the servers)."""

    def scale(self, tables: Sequence[ShardedTable], factor: Tensor) -> None:
        """The aggregates of ``tables`` multiplied by ``factor`` (a clip's scale)."""


class OnServers:
    """The default: the operations run on the servers, beside the aggregate."""

    #: the servers divide each arriving gradient row by the workers (an average of the
    #: workers' rows: `ShardedTable.divides_rows_on_arrival`)
    divides_on_arrival = True

    def average(self, tables: Sequence[Table], verdict: Verdict) -> None:
        return  # (divided as the rows arrived)

    def scale(self, tables: Sequence[ShardedTable], factor: Tensor) -> None:
        for table in tables:
            table.scale_grad(factor)


class OnWorkers:
    """The ablation's baseline: the aggregated rows travel to the workers and back."""

    divides_on_arrival = False

    def average(self, tables: Sequence[Table], verdict: Verdict) -> None:
        averaged = [table for table in tables if isinstance(table, ShardedTable)
                    and table.average]
        if not averaged or not verdict.carried:
            return
        if verdict.stale_shards:  # (the same count on every rank: the ranks' sum)
            raise UnsupportedProgramError(
                "Config.after_aggregation='workers' averages a step's aggregated gradient "
                "after the sum, and server-held tables still held gradient from an earlier "
                "step (no zero_grad since): call optimizer.zero_grad() every step, or leave "
                "after_aggregation at 'servers'")
        world = averaged[0].worker.world_size
        _round_trip(averaged, lambda values: values.div_(world))

    def scale(self, tables: Sequence[ShardedTable], factor: Tensor) -> None:
        if not bool(torch.isfinite(factor)):  # (0 x inf: every row, the servers' own way)
            OnServers().scale(tables, factor)
            return
        _round_trip(list(tables), lambda values: values.mul_(factor.to(values.dtype)))


#: each placement by `Config.after_aggregation`'s word
AFTER_AGGREGATION: dict[str, type[OnServers] | type[OnWorkers]] = {
    "servers": OnServers, "workers": OnWorkers}


def _round_trip(tables: Sequence[ShardedTable], operation: Callable[[Tensor], Tensor]) -> None:
    """Every server's aggregated values of ``tables`` to every worker, ``operation`` applied
    there, and the next rank's result back into the server's aggregate (collective: three
    all_to_alls, the first the count message)."""
    if not tables:
        return
    first = tables[0]
    world, rank = first.worker.world_size, first.worker.rank
    values = {table.name: table.aggregated_values() for table in tables}
    out = Hop.open_many({name: [v.numel()] * world for name, v in values.items()},
                        group=first.group, traffic=first.traffic,
                        num_rows={table.name: table.num_rows for table in tables},
                        device=first.device)
    arrived = out.forward_many({name: v.repeat(world) for name, v in values.items()})
    mine = [server for server in range(world) if (server + 1) % world == rank]
    results, back_counts, own_counts = {}, {}, {}
    for name, received in arrived.items():
        computed = operation(received)  # every worker computes every server's
        counts = out.recv_counts[name]
        pieces = computed.split(counts)
        results[name] = torch.cat([pieces[server] for server in mine])
        back_counts[name] = [counts[s] if s in mine else 0 for s in range(world)]
        own_counts[name] = [values[name].numel() if p == (rank + 1) % world else 0
                            for p in range(world)]
    back = Hop(back_counts, own_counts, first.group, first.traffic).forward_many(results)
    for table in tables:
        table.set_aggregated_values(back[table.name])
