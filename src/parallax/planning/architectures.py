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
rule). `build_layout` creates the tables from those answers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from parallax.cluster import WorkerInfo
from parallax.config import ArchitectureName, Config, ShardingName
from parallax.engine.optimizers.shard_optimizer import take_user_state
from parallax.engine.tables.columns import column_slices, slices_of_rows, slices_view
from parallax.engine.tables.exchange import Traffic
from parallax.engine.tables.handles import release
from parallax.engine.tables.layout import Layout, Placement
from parallax.engine.tables.replicated import ReplicatedTable
from parallax.engine.tables.server_table import ShardedTable
from parallax.engine.tables.sharding import POOLED, POOLED_BY_ROWS, ROWS, PooledByColumns
from parallax.engine.tables.step_context import TableSteps
from parallax.engine.tables.table import Table
from parallax.errors import ArgumentError, InternalError, UnsupportedProgramError
from parallax.model.detect import SparseUse
from parallax.model.meta_init import recipe_of
from parallax.planning import cost
from parallax.planning.sparsity import Sparsity

__all__ = ["ARCHITECTURES", "MAX_POOLED_REST_EXTRA_BYTES", "MIN_AGGREGATION_SAVING", "Architecture",
           "Layout", "ParameterCost", "architecture_of", "build_layout", "largest_first",
           "pool_the_rest", "server_held"]


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


def build_layout(model: nn.Module, sparse_uses: dict[str, SparseUse], *, config: Config,
                 worker: WorkerInfo, group: dist.ProcessGroup, traffic: Traffic,
                 optimizers: Sequence[torch.optim.Optimizer] = ()) -> Layout:
    """Create the tables (collective: initial values come from rank 0). Each server-held
    table's storage in the program's model, and the state ``optimizers`` hold for it, go as
    soon as the table is scattered (`Layout.user_state` keeps this server's rows of that
    state for the servers' optimizer): a lower peak for a model built as usual."""
    architecture = architecture_of(config)
    aggregates = architecture.aggregates_locally(config)
    params = dict(model.named_parameters())
    layout = Layout()
    servers = worker.server_ranks
    num_partitions = config.num_partitions or len(servers)
    pins = _pins(sparse_uses, config)
    owners = pooled_owners(sparse_uses, params, pins, len(servers))
    by_rows = {name for name, (kind, _) in pins.items() if kind == ShardingName.POOLED_BY_ROWS}
    for name in sorted(by_rows):
        use = sparse_uses[name]
        layer = model.get_submodule(use.module_path) if use.module_path else None
        if getattr(layer, "mode", None) == "max":
            raise UnsupportedProgramError(
                f"Config.{pins[name][1]} names {name!r}, whose nn.EmbeddingBag has "
                f"mode='max': pooling by rows adds every server's share of a bag, which "
                f"gives a sum or a mean, not a max; pool it whole on one owner (\"pooled\", "
                f"Config.pooled_tables) or leave it to the row path")
    by_columns = sorted(name for name, (kind, _) in pins.items()
                        if kind == ShardingName.POOLED_BY_COLUMNS)
    for name, use in sorted(sparse_uses.items()):
        sparse_grad = use.sparse_grad or config.lazy_sparse_updates
        if name in by_columns:
            _drop_unread_copy(params[name], name, worker)
            table = _column_table(name, params[name], by_columns.index(name), config=config,
                                  worker=worker, group=group, traffic=traffic,
                                  sparse_grad=sparse_grad, steps=layout.steps)
            layout.add(table)
            partitioning = table.partitioning
            layout.placements[name] = Placement("ps", table.sharding.slices, tuple(
                servers[partitioning.server_of_partition(k)]
                for k in range(table.sharding.slices)))
            _hand_over_early(layout, table, params[name], optimizers, worker)
        elif name in owners:
            _drop_unread_copy(params[name], name, worker)
            table = ShardedTable(
                name, params[name], num_partitions=1, worker=worker, group=group,
                traffic=traffic, sparse_grad=sparse_grad, average=config.average_sparse,
                first_server=owners[name], initial_rows=_initial_rows(params[name]),
                steps=layout.steps)
            table.sharding = POOLED
            layout.add(table)
            layout.placements[name] = Placement("ps", 1, (servers[owners[name]],))
            _hand_over_early(layout, table, params[name], optimizers, worker)
        elif not architecture.sparse_on_servers:
            layout.add(ReplicatedTable(
                name, params[name], worker=worker, group=group, traffic=traffic,
                sparse_grad=sparse_grad, average=config.average_sparse,
                batch_dependent=use.batch_dependent, steps=layout.steps))
            layout.placements[name] = Placement("allgatherv", 0, ())
        else:
            _drop_unread_copy(params[name], name, worker)
            table = ShardedTable(
                name, params[name], num_partitions=num_partitions, worker=worker, group=group,
                traffic=traffic, sparse_grad=sparse_grad, average=config.average_sparse,
                local_aggregation=aggregates and name not in by_rows,
                batch_dependent=use.batch_dependent, initial_rows=_initial_rows(params[name]),
                steps=layout.steps)
            table.sharding = POOLED_BY_ROWS if name in by_rows else ROWS
            layout.add(table)
            layout.placements[name] = Placement("ps", num_partitions, servers)
            _hand_over_early(layout, layout.sparse[name], params[name], optimizers, worker)
    if architecture.dense_on_servers:
        dense = {n: p for n, p in params.items() if p.requires_grad and n not in sparse_uses}
        for name, server in greedy_placement(dense, layout.sparse, len(servers)).items():
            weight = params[name].detach()
            layout.pulled_whole[name] = ShardedTable(
                name, weight.reshape(1) if weight.dim() == 0 else weight, num_partitions=1,
                worker=worker, group=group, traffic=traffic, sparse_grad=False,
                average=config.average_dense, local_aggregation=aggregates,
                first_server=server, initial_rows=_initial_rows(params[name]),
                steps=layout.steps)
            layout.placements[name] = Placement("ps", 1, (servers[server],))
    return layout


def _column_table(name: str, param: nn.Parameter, index: int, *, config: Config,
                  worker: WorkerInfo, group: dist.ProcessGroup, traffic: Traffic,
                  sparse_grad: bool, steps: TableSteps) -> ShardedTable:
    """A table of `Config.pooled_by_columns` (the ``index``-th): its rows cut into the most
    column slices that divide them, at most one per server, slice k on its own server (each
    table's first slice one server further on, so the slices of several spread out); the
    table's rows are the slices' (`parallax.engine.tables.columns`)."""
    servers = len(worker.server_ranks)
    slices = column_slices(math.prod(param.shape[1:]), servers)
    recipe = _initial_rows(param)
    table = ShardedTable(
        name, slices_view(param.detach(), slices), num_partitions=slices, worker=worker,
        group=group, traffic=traffic, sparse_grad=sparse_grad, average=config.average_sparse,
        first_server=index * slices % servers,
        initial_rows=None if recipe is None else slices_of_rows(recipe, slices), steps=steps)
    table.sharding = PooledByColumns(slices)
    return table


def _drop_unread_copy(param: nn.Parameter, name: str, worker: WorkerInfo) -> None:
    """Off rank 0 the program's copy of a table about to be scattered is never read (the
    servers' rows are rank 0's values): it goes before this rank's shard is made, so that a
    server's peak is not the program's build plus its shards."""
    if worker.rank != 0:  # (a parallax.meta_init parameter has no copy: release skips it)
        release(param, name=name, device=worker.device, rank=worker.rank)


def _hand_over_early(layout: Layout, table: Table, param: nn.Parameter,
                     optimizers: Sequence[torch.optim.Optimizer], worker: WorkerInfo) -> None:
    """The program's copy of a just-scattered table, and its optimizer state, are not needed
    any more: the copy goes now, before the state's rows are made (`take_user_state` drops
    the state entry by entry as each is scattered), and both before the next table's shard."""
    release(param, name=table.name, device=worker.device, rank=worker.rank)
    held = table.held
    if held is not None:
        layout.user_state[table.name] = take_user_state(held, param, optimizers)


def _pins(sparse_uses: dict[str, SparseUse],
          config: Config) -> dict[str, tuple[ShardingName, str]]:
    """Each table the program pins (`Config.pinned_sharding`), with the field that pins it;
    refuses a name that is no table, and a pooled kind on a table no owner can pool
    exactly."""
    named = config.named_pins()
    for name, (kind, field) in named.items():
        if name not in sparse_uses and kind == ShardingName.ROWS:
            raise ArgumentError(
                f"Config.{field} names {name!r}, which is not a sparse parameter: "
                f"{sorted(sparse_uses)}")
    pins = {}
    for name in sorted(sparse_uses):
        pin = config.pinned_sharding(name)
        if pin is not None:
            pins[name] = pin
    for name, (kind, field) in {**named, **pins}.items():
        if kind != ShardingName.ROWS:
            _check_poolable(name, sparse_uses.get(name), sparse_uses, field)
    return pins


def pooled_owners(sparse_uses: dict[str, SparseUse], params: dict[str, nn.Parameter],
                  pins: dict[str, tuple[ShardingName, str]],
                  num_servers: int) -> dict[str, int]:
    """The server (an index into the server ranks) holding each table pinned ``"pooled"``
    (`Config.sharding`, `Config.pooled_tables`) whole: largest first, onto the server with
    the fewest pooled bytes so far."""
    names = [name for name, (kind, _) in pins.items() if kind == ShardingName.POOLED]
    return largest_first({name: params[name].nbytes for name in names}, [0] * num_servers)


def _check_poolable(name: str, use: SparseUse | None, sparse_uses: dict[str, SparseUse],
                    field: str) -> None:
    """Refuse a name of ``Config.<field>`` that is not an ``nn.EmbeddingBag`` table whose bags
    an owner can pool exactly."""
    if use is None or use.kind not in POOLABLE_KINDS:
        what = "not a sparse parameter" if use is None else f"read by {use.kind!r}"
        raise ArgumentError(
            f"Config.{field} names {name!r}, which is {what}; it takes the parameter names "
            f"of nn.EmbeddingBag tables, or of tables looked up by nn.Embedding or a gather "
            f"whose rows the program only sums or averages over each row of ids: "
            f"{sorted(n for n, u in sparse_uses.items() if u.kind in POOLABLE_KINDS)}")
    if use.batch_dependent is not None:
        raise UnsupportedProgramError(
            f"Config.{field} names {name!r}, whose layer has "
            f"{use.batch_dependent.describe()}: that depends on every row the global batch "
            f"reads, which only the row path applies exactly; leave it out of {field}")


def _initial_rows(param: nn.Parameter) -> Callable[[Tensor], Tensor] | None:
    """For a parameter built in `parallax.meta_init`: its rows' initial values by global id."""
    recipe = recipe_of(param)
    return None if recipe is None else recipe.rows


def greedy_placement(dense: dict[str, nn.Parameter], sparse: dict[str, Table],
                     num_servers: int) -> dict[str, int]:
    """Each dense parameter whole on one server: largest first, onto the server holding the
    fewest bytes so far (sparse shards included)."""
    load = [0] * num_servers
    for table in sparse.values():
        held = table.held
        if held is not None:
            row_bytes = table.dtype.itemsize * math.prod(table.row_shape)
            for server, rows in enumerate(held.partitioning.shard_rows):
                load[server] += rows * row_bytes
    return largest_first({name: param.nbytes for name, param in dense.items()}, load)


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
