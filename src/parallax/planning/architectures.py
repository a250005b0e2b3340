"""The architectures: which parameter is synchronised how, and what that is predicted to cost.

| architecture | dense parameters | sparse parameters |
|---|---|---|
| hybrid (default) | replicated, AllReduce (DDP) | servers, local aggregation where it pays |
| allreduce | replicated, AllReduce (DDP) | replicated, AllGatherv of (ids, rows) |
| ps | servers, whole parameter on one server | servers |
| optps | as ps | as ps, local aggregation |

Each is one `Architecture` subclass, registered under its `ArchitectureName` in
`ARCHITECTURES`; `architecture_of(config)` is the one place a `Config.architecture` string is
looked up. A subclass says where parameters live (``sparse_on_servers``, ``dense_on_servers``),
whether it aggregates locally by default, its Table-3 bytes per parameter (``predicted_bytes``)
and whether a measured sparse table moves to AllReduce (``moves_to_allreduce``, the hybrid's
rule). `parallax.planning.table_kinds.build_layout` creates the tables from those answers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from parallax.cluster import WorkerInfo
from parallax.config import ArchitectureName, Config
from parallax.engine.tables.layout import Layout
from parallax.engine.tables.table import Table
from parallax.errors import InternalError
from parallax.model.detect import SparseUse
from parallax.planning import cost
from parallax.planning.sparsity import Sparsity

__all__ = ["ARCHITECTURES", "MAX_POOLED_REST_EXTRA_BYTES", "MIN_AGGREGATION_SAVING", "Architecture",
           "Layout", "ParameterCost", "architecture_of", "largest_first", "pool_the_rest",
           "server_held"]


@dataclass(frozen=True)
class ParameterCost:
    """What the byte model needs of one parameter: its rows, their size, and, for a sparse
    one, the rows one worker (``used``) and one machine (``used_machine``) read per step."""

    rows: int
    row_bytes: float
    sparse: bool
    used: float | None = None
    used_machine: float | None = None
    sync: str = "allreduce"  # where it lives in this run (the hybrid may have moved it)
    #: the bytes of the AllReduce it is summed in, when more than its own (a dense
    #: parameter's: all dense gradients, one sum: `parallax.engine.tables.reduction`)
    payload: float | None = None
    #: an nn.EmbeddingBag's ids and bags per worker and step (once measured), and whether
    #: its bags are pooled on its owner in this run (`Config.pooled_tables`)
    bag_ids: float | None = None
    bags: float | None = None
    pooled: bool = False
    #: the ranks that pool each bag: 1 (`Config.pooled_tables`), the servers holding its
    #: rows (`Config.pooled_by_rows`) or its column slices (`Config.pooled_by_columns`)
    pooled_owners: int = 1
    pooled_by_columns: bool = False

    @property
    def total(self) -> float:
        return self.rows * self.row_bytes


class Architecture:
    """One architecture's rules. Subclass, set the class attributes, override what differs,
    and add an instance to `ARCHITECTURES` (keyed by a new `ArchitectureName`)."""

    name: ClassVar[ArchitectureName]
    sparse_on_servers: ClassVar[bool] = True
    dense_on_servers: ClassVar[bool] = False
    aggregates_by_default: ClassVar[bool] = False
    #: where its rule keeps the leader hop (`Config.local_aggregation` unset), the hop is
    #: kept only if a timed trial finds it faster (`parallax.step.aggregation_trial`)
    tries_local_aggregation: ClassVar[bool] = False

    def aggregates_locally(self, config: Config) -> bool:
        """Whether sparse exchanges go through each machine's leader under ``config``."""
        if config.sync != "sync":  # each worker pulls and pushes on its own clock
            return False
        if config.local_aggregation is not None:
            return config.local_aggregation
        return self.aggregates_by_default

    def server_held(self, model: nn.Module,
                    sparse_uses: dict[str, SparseUse]) -> dict[str, nn.Parameter]:
        """The parameters whose updates the servers apply (with the user's optimizer)."""
        params = dict(model.named_parameters())
        held = {name: params[name] for name in sparse_uses} if self.sparse_on_servers else {}
        if self.dense_on_servers:
            held.update({n: p for n, p in params.items() if p.requires_grad})
        return held

    def predicted_bytes(self, param: ParameterCost, shape: cost.Shape, *,
                        local_aggregation: bool | None) -> float | None:
        """Inter-machine bytes per machine and step for ``param`` (None: α not measured)."""
        raise NotImplementedError

    def moves_to_allreduce(self, table: Table, measured: Sparsity, *, config: Config,
                           worker: WorkerInfo) -> tuple[bool, str]:
        """Whether a server-held sparse table should become a replica with an AllReduced
        gradient once its α is measured, and why. Only the hybrid moves tables."""
        return False, ""

    def pools_bags(self, table: Table, use: SparseUse, measured: Sparsity, *, config: Config,
                   worker: WorkerInfo) -> tuple[bool, str]:
        """Whether a server-held ``nn.EmbeddingBag`` table pulling its rows should have its
        bags pooled on one owner instead, once its ids and bags per step are measured, and
        why. Only the hybrid decides, and only where `Config.pooled_tables` is None."""
        return False, ""

    def pools_by_rows(self, table: Table, use: SparseUse, measured: Sparsity, *,
                      config: Config, worker: WorkerInfo) -> tuple[float | None, str]:
        """For a table `pools_bags` would pool but no server can hold whole: its predicted
        bytes per machine and step pooled by rows (every server its rows' share,
        `Config.pooled_by_rows`) where the bytes model predicts that to move fewer bytes
        than the rows (else None), and why."""
        return self._spread(table, use, measured, config=config, worker=worker,
                            owners=len(worker.server_ranks), by_columns=False,
                            how="pooled by rows instead, each server its rows' share")

    def pools_by_columns(self, table: Table, use: SparseUse, measured: Sparsity, *,
                         config: Config, worker: WorkerInfo,
                         slices: int) -> tuple[float | None, str]:
        """As `pools_by_rows`, held as ``slices`` column slices instead, each server of a
        slice pooling it over every bag (`Config.pooled_by_columns`)."""
        if slices < 2:
            return None, ""
        return self._spread(table, use, measured, config=config, worker=worker, owners=slices,
                            by_columns=True,
                            how=f"pooled by columns instead, {slices} slices on their own "
                                f"servers")

    def _spread(self, table: Table, use: SparseUse, measured: Sparsity, *, config: Config,
                worker: WorkerInfo, owners: int, by_columns: bool,
                how: str) -> tuple[float | None, str]:
        """A pooling over ``owners`` servers' predicted bytes where it moves fewer than the
        rows (else None), and why (``how``, then the bytes)."""
        predicted = self.pooling_bytes(table, use, measured, config=config, worker=worker,
                                       owners=owners, by_columns=by_columns)
        if predicted is None:
            return None, ""
        rows, pooled = predicted
        return pooled if pooled < rows else None, (
            f"{how}: predicted {pooled:,.0f} B vs rows {rows:,.0f} B per step")

    def pooling_bytes(self, table: Table, use: SparseUse, measured: Sparsity, *,
                      config: Config, worker: WorkerInfo, owners: int = 1,
                      by_columns: bool = False) -> tuple[float, float] | None:
        """``(rows, pooled)``: the predicted bytes per machine and step of ``table``'s rows
        (at their cheapest) and of its bags pooled on ``owners`` owners (holding column
        slices where ``by_columns``); None where the architecture would not pool it (see
        `pools_bags`)."""
        return None

    def keeps_local_aggregation(self, tables: dict[str, Table], measured: dict[str, Sparsity],
                                *, config: Config, worker: WorkerInfo) -> tuple[bool, str]:
        """Whether the sparse exchanges keep going through each machine's leader once α and
        α_m are measured, and why. The architectures as named keep their rule; the hybrid
        decides (`Hybrid.keeps_local_aggregation`)."""
        return self.aggregates_locally(config), ""


#: The hybrid's reason for replicating a table on one worker (the runner keeps the table on
#: the servers in the own loop: `parallax.step.plan_keeper`)
ONE_WORKER = "one worker: no exchange, the replica is updated where touched"
#: the lookups whose bags an owner pools: nn.EmbeddingBag, and nn.Embedding or a hand-written
#: gather where the program only sums or averages its rows over each row of ids
#: (`parallax.model.bag_reductions`)
POOLABLE_KINDS = ("embedding_bag", "embedding", "gather")

# The leader hop costs a second exchange each way, a merge and a fan-out per step: a small
# byte saving costs more time than it saves (the LM at 2 x 2, in
# docs/history/2026-11-23-results-log.md). The hybrid keeps it only where it saves at least
# this fraction of the bytes.
MIN_AGGREGATION_SAVING = 0.2


# Pooling a table's bags on its owner costs an exchange of its own each step (a header, the
# ids, the pooled rows, their gradients: four collectives). Pooling was faster wherever it was
# predicted to move fewer bytes than the rows (record compare-recsys-history32-2x2-1gbit);
# below this many bytes of rows per machine and step nothing was measured: a table keeps its rows.
MIN_POOLED_ROWS_BYTES = 64_000

# A step that pulls some tables' rows and pools other tables' bags pays both exchanges: 3
# collectives more than one that pools every table (the pull's two and a push message).
# Pooling every bag table was faster than pooling the history alone although it moves more
# bytes (record compare-recsys-history32-2x2-1gbit-riders). Once a table pools, the hybrid
# pools every other server-held table too where each can (no row exchange is left) and that
# adds at most this many bytes per machine and step: at 1 Gbit/s less time than the 3
# collectives cost; on a much slower link pin `Config.pooled_tables`.
MAX_POOLED_REST_EXTRA_BYTES = 256_000


def pool_the_rest(rest: dict[str, tuple[float, float] | None]) -> tuple[bool, str]:
    """Whether, with some tables pooled, the other server-held tables (``rest``: each one's
    ``(rows, pooled)`` predicted bytes, None where it cannot pool) should pool too, and why
    (`MAX_POOLED_REST_EXTRA_BYTES`)."""
    if not rest or any(predicted is None for predicted in rest.values()):
        return False, ""
    rows = sum(p[0] for p in rest.values() if p is not None)
    pooled = sum(p[1] for p in rest.values() if p is not None)
    return (pooled - rows <= MAX_POOLED_REST_EXTRA_BYTES,
            f"bags pooled with the other tables' (no table left pulling rows: 3 collectives "
            f"fewer a step): predicted {pooled:,.0f} B vs rows {rows:,.0f} B per step for the "
            f"tables pooled so")


class Hybrid(Architecture):
    name = ArchitectureName.HYBRID
    aggregates_by_default = True
    tries_local_aggregation = True

    def predicted_bytes(self, param: ParameterCost, shape: cost.Shape, *,
                        local_aggregation: bool | None) -> float | None:
        if not param.sparse or param.sync == "allreduce":
            return cost.allreduce_dense(param.total, shape, payload=param.payload,
                                        flat=shape.flat_dense and not param.sparse)
        if param.pooled:
            return (None if param.bags is None or param.bag_ids is None
                    else cost.pooled_bags(param.bag_ids, param.bags, param.row_bytes, shape,
                                          owners=param.pooled_owners,
                                          by_columns=param.pooled_by_columns))
        aggregated = self.aggregates_by_default if local_aggregation is None else local_aggregation
        used = param.used_machine if aggregated else param.used
        if used is None:
            return None
        return cost.ps_rows(used, param.row_bytes, shape, local_aggregation=aggregated)

    def moves_to_allreduce(self, table: Table, measured: Sparsity, *, config: Config,
                           worker: WorkerInfo) -> tuple[bool, str]:
        """α above `Config.alpha_threshold` when set, else fewer predicted bytes than the PS
        (using the measured α_m of the machines' merged rows when aggregating locally); with
        one worker, always: nothing crosses a wire either way, and the replica skips the
        exchange with itself (the LM's one-worker step as replicas, `architecture="allreduce"`,
        against the servers, on the CPU and on an H200). A table
        pooled on its owner stays (`Config.pooled_tables` is the user's choice)."""
        if not table.on_servers or table.sharding.pools:
            return False, ""
        if config.alpha_threshold is not None:
            threshold = config.alpha_threshold
            return (measured.alpha > threshold,
                    f"alpha {measured.alpha:.3f} > {threshold:.3f}: AllReduce")
        if worker.world_size == 1:
            return True, ONE_WORKER
        aggregated = table.local_aggregation and measured.alpha_machine is not None
        ps_bytes = _ps_bytes(table, measured, worker, aggregated=aggregated)
        ar_bytes = cost.allreduce_dense(_row_bytes(table) * table.num_rows, _shape(worker))
        return (ar_bytes < ps_bytes,
                f"AllReduce predicted {ar_bytes:,.0f} B < PS {ps_bytes:,.0f} B per step")

    def pools_bags(self, table: Table, use: SparseUse, measured: Sparsity, *, config: Config,
                   worker: WorkerInfo) -> tuple[bool, str]:
        """With `Config.pooled_tables` None, on the synchronous exchange: pool where the bytes
        model predicts pooling to move fewer bytes than the rows and than an AllReduce of the
        whole table, for a table whose rows move
        at least `MIN_POOLED_ROWS_BYTES` per machine and step (a table whose lookups
        renormalise or scale by frequency, or whose per-sample weights need a gradient,
        keeps its rows)."""
        predicted = self.pooling_bytes(table, use, measured, config=config, worker=worker)
        if predicted is None:
            return False, ""
        rows, pooled = predicted
        replicated = cost.allreduce_dense(_row_bytes(table) * table.num_rows, _shape(worker))
        pool = rows >= MIN_POOLED_ROWS_BYTES and pooled < min(rows, replicated)
        return pool, (f"bags pooled on an owner: predicted {pooled:,.0f} B vs rows "
                      f"{rows:,.0f} B, AllReduce {replicated:,.0f} B per step")

    def pooling_bytes(self, table: Table, use: SparseUse, measured: Sparsity, *,
                      config: Config, worker: WorkerInfo, owners: int = 1,
                      by_columns: bool = False) -> tuple[float, float] | None:
        if (config.pinned_sharding(table.name) is not None or config.sync != "sync"
                or table.sharding.pools
                or not table.on_servers or use.kind not in POOLABLE_KINDS
                or use.batch_dependent is not None or measured.weights_need_grad
                or measured.rows_read_otherwise
                or measured.bags is None or measured.bag_ids is None):
            return None
        # the rows at their cheapest: through the leader hop or not (decided after this)
        rows = _ps_bytes(table, measured, worker, aggregated=False)
        if table.local_aggregation and measured.alpha_machine is not None:
            rows = min(rows, _ps_bytes(table, measured, worker, aggregated=True))
        return rows, cost.pooled_bags(measured.bag_ids, measured.bags, _row_bytes(table),
                                      _shape(worker), owners=owners, by_columns=by_columns)

    def keeps_local_aggregation(self, tables: dict[str, Table], measured: dict[str, Sparsity],
                                *, config: Config, worker: WorkerInfo) -> tuple[bool, str]:
        """With `Config.local_aggregation` unset: keep the leader hop only if the measured
        α_m of the machines' merged rows makes the server-held tables' predicted bytes at
        least `MIN_AGGREGATION_SAVING` smaller than every worker exchanging on its own."""
        if config.local_aggregation is not None:
            return config.local_aggregation, ""
        merged = separate = 0.0
        for name, table in tables.items():
            if (not (table.on_servers and table.local_aggregation)
                    or measured[name].alpha_machine is None):
                continue
            merged += _ps_bytes(table, measured[name], worker, aggregated=True)
            separate += _ps_bytes(table, measured[name], worker, aggregated=False)
        if separate == 0:
            return any(t.on_servers and t.local_aggregation for t in tables.values()), ""
        saving = 1 - merged / separate
        keep = saving >= MIN_AGGREGATION_SAVING
        return keep, (f"local aggregation {'kept' if keep else 'off'}: predicted "
                      f"{merged:,.0f} B merged vs {separate:,.0f} B per worker, "
                      f"{saving:.0%} {'>=' if keep else '<'} {MIN_AGGREGATION_SAVING:.0%} saved")


def _shape(worker: WorkerInfo) -> cost.Shape:
    machines = len(worker.server_ranks)
    return cost.Shape(machines, max(1, worker.world_size // machines),
                      small_sums=worker.device.type == "cpu")


def _row_bytes(table: Table) -> int:
    return table.dtype.itemsize * math.prod(table.row_shape)


def _ps_bytes(table: Table, measured: Sparsity, worker: WorkerInfo, *, aggregated: bool) -> float:
    """Predicted PS bytes of ``table`` at its measured α (α_m when ``aggregated``)."""
    alpha = measured.alpha_machine if aggregated else measured.alpha
    if alpha is None:
        raise InternalError(f"'{table.name}': no machine-level α measured; please report it")
    return cost.ps_rows(alpha * table.num_rows, _row_bytes(table), _shape(worker),
                        local_aggregation=aggregated)


class AllReduce(Architecture):
    name = ArchitectureName.ALLREDUCE
    sparse_on_servers = False

    def predicted_bytes(self, param: ParameterCost, shape: cost.Shape, *,
                        local_aggregation: bool | None) -> float | None:
        if not param.sparse:
            return cost.allreduce_dense(param.total, shape, payload=param.payload,
                                        flat=shape.flat_dense and not param.sparse)
        if param.used is None:
            return None
        return cost.allgatherv_rows(param.used, param.row_bytes, shape)


class PS(Architecture):
    name = ArchitectureName.PS
    dense_on_servers = True

    def predicted_bytes(self, param: ParameterCost, shape: cost.Shape, *,
                        local_aggregation: bool | None) -> float | None:
        aggregated = self.aggregates_by_default  # the column is the architecture as named
        used = (param.used_machine if aggregated else param.used) if param.sparse else param.rows
        if used is None:
            return None
        return cost.ps_rows(used, param.row_bytes, shape, local_aggregation=aggregated)


class OptPS(PS):
    name = ArchitectureName.OPTPS
    aggregates_by_default = True


ARCHITECTURES: dict[ArchitectureName, Architecture] = {
    a.name: a for a in (Hybrid(), AllReduce(), PS(), OptPS())}


def architecture_of(config: Config) -> Architecture:
    """The architecture ``config`` names."""
    return ARCHITECTURES[ArchitectureName(config.architecture)]


def server_held(model: nn.Module, sparse_uses: dict[str, SparseUse],
                config: Config) -> dict[str, nn.Parameter]:
    """The parameters whose updates the servers apply (with the user's optimizer, per shard)."""
    return architecture_of(config).server_held(model, sparse_uses)


def largest_first(sizes: dict[str, int], load: list[int], *,
                  fits: Callable[[str, int], bool] | None = None) -> dict[str, int]:
    """Each of ``sizes`` (bytes by name) onto one server (an index into ``load``, each
    server's bytes so far, updated): largest first, onto the server holding the fewest bytes
    (the lowest index among equals), so every rank places alike. ``fits(name, server)``:
    whether a server can take it, asked of the servers in that order (the first that says
    yes takes it; a name no server can take is left out and adds no load)."""
    placement = {}
    for name, size in sorted(sizes.items(), key=lambda item: (-item[1], item[0])):
        for server in sorted(range(len(load)), key=lambda s: (load[s], s)):
            if fits is None or fits(name, server):
                placement[name] = server
                load[server] += size
                break
    return placement
