"""How a table of each sharding kind is built: one `TableKind` per kind
(`parallax.engine.tables.sharding`), looked up by the kind's name in `TABLE_KINDS`.

`build_layout` asks each sparse table its kind once: the program's pin (`Config.sharding`
and its shorthands), else the architecture's default (rows partitioned over the servers, or a
replica on every worker where the architecture keeps sparse parameters off the servers), and
the kind builds the table and says where it lives (its `Placement`). A new kind is its
`Sharding` value, its class here and its entry in `TABLE_KINDS`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from parallax.cluster import WorkerInfo
from parallax.config import Config, ShardingName
from parallax.engine.optimizers.shard_optimizer import take_user_state
from parallax.engine.tables.after_aggregation import AFTER_AGGREGATION
from parallax.engine.tables.columns import column_slices, slices_of_rows, slices_view
from parallax.engine.tables.exchange import Traffic
from parallax.engine.tables.handles import release
from parallax.engine.tables.id_dedup import ID_DEDUP
from parallax.engine.tables.layout import Layout, Placement
from parallax.engine.tables.replicated import ReplicatedTable
from parallax.engine.tables.server_table import ShardedTable
from parallax.engine.tables.sharding import (
    POOLED,
    POOLED_BY_ROWS,
    ROWS,
    PooledByColumns,
    Sharding,
)
from parallax.engine.tables.step_context import TableSteps
from parallax.engine.tables.table import Table
from parallax.errors import ArgumentError, UnsupportedProgramError
from parallax.model.detect import SparseUse
from parallax.model.meta_init import recipe_of
from parallax.planning.architectures import (
    POOLABLE_KINDS,
    Architecture,
    architecture_of,
    largest_first,
)

__all__ = ["REPLICATED_KIND", "TABLE_KINDS", "LayoutBuild", "TableKind", "build_layout",
           "greedy_placement", "pooled_owners"]

REPLICATED_KIND = "replicated"  # the kind of a table the architecture keeps off the servers


@dataclass
class LayoutBuild:
    """What building one layout's tables needs, worked out once for all of them."""

    model: nn.Module
    config: Config
    worker: WorkerInfo
    group: dist.ProcessGroup
    traffic: Traffic
    layout: Layout
    architecture: Architecture
    params: dict[str, nn.Parameter]
    optimizers: Sequence[torch.optim.Optimizer]
    #: the server (an index into the server ranks) holding each table pooled whole
    owners: dict[str, int] = dataclasses.field(default_factory=dict)
    #: the tables pooled by columns, in order (each one's first slice a server further on)
    by_columns: list[str] = dataclasses.field(default_factory=list)

    @property
    def servers(self) -> tuple[int, ...]:
        return self.worker.server_ranks

    @property
    def num_partitions(self) -> int:
        return self.config.num_partitions or len(self.worker.server_ranks)


class TableKind:
    """How the tables of one sharding kind are built (a class per kind)."""

    #: the program's copy goes once the table is built, and with it the optimizer state
    #: held for it (the servers hold its rows)
    scattered: ClassVar[bool] = True

    def check(self, name: str, use: SparseUse, build: LayoutBuild, field_: str) -> None:
        """Refuse, before any table is built, a table this kind cannot hold exactly
        (``field_``: the `Config` field that pins it)."""

    def build(self, name: str, use: SparseUse, build: LayoutBuild) -> tuple[Table, Placement]:
        """The table (collective: its initial values come from rank 0), and where its rows
        live (the plan's record)."""
        raise NotImplementedError


def _divides_on_arrival(config: Config) -> bool:
    """Whether a server-held table's servers average the workers' rows as they arrive
    (`Config.after_aggregation`: `parallax.engine.tables.after_aggregation`)."""
    return AFTER_AGGREGATION[config.after_aggregation].divides_on_arrival


def _sparse_grad(use: SparseUse, config: Config) -> bool:
    return use.sparse_grad or config.lazy_sparse_updates


class RowsPulledKind(TableKind):
    """Rows partitioned over the servers, pulled each step
    (`parallax.engine.tables.sharding.RowsPulled`)."""

    sharding: ClassVar[Sharding] = ROWS

    def build(self, name: str, use: SparseUse, build: LayoutBuild) -> tuple[Table, Placement]:
        config, param = build.config, build.params[name]
        table = ShardedTable(
            name, param, num_partitions=build.num_partitions, worker=build.worker,
            group=build.group, traffic=build.traffic, sparse_grad=_sparse_grad(use, config),
            average=config.average_sparse,
            local_aggregation=self.aggregates(build),
            batch_dependent=use.batch_dependent, initial_rows=_initial_rows(param),
            steps=build.layout.steps, divides_on_arrival=_divides_on_arrival(config),
            id_requests=ID_DEDUP[config.id_dedup]())
        table.sharding = self.sharding
        return table, Placement("ps", build.num_partitions, build.servers)

    def aggregates(self, build: LayoutBuild) -> bool:
        """Whether its pulls go through each machine's leader (`Config.local_aggregation`)."""
        return build.architecture.aggregates_locally(build.config)


class PooledByRowsKind(RowsPulledKind):
    """Rows partitioned over the servers, each pooling its rows' share of every bag
    (`parallax.engine.tables.sharding.PooledByRows`)."""

    sharding: ClassVar[Sharding] = POOLED_BY_ROWS

    def check(self, name: str, use: SparseUse, build: LayoutBuild, field_: str) -> None:
        layer = build.model.get_submodule(use.module_path) if use.module_path else None
        if getattr(layer, "mode", None) == "max":
            raise UnsupportedProgramError(
                f"Config.{field_} names {name!r}, whose nn.EmbeddingBag has "
                f"mode='max': pooling by rows adds every server's share of a bag, which "
                f"gives a sum or a mean, not a max; pool it whole on one owner (\"pooled\", "
                f"Config.pooled_tables) or leave it to the row path")

    def aggregates(self, build: LayoutBuild) -> bool:
        return False  # (its bags are pooled on the servers: no leader merges rows)


class PooledWholeKind(TableKind):
    """Held whole on one server, which pools every bag
    (`parallax.engine.tables.sharding.PooledWhole`)."""

    def build(self, name: str, use: SparseUse, build: LayoutBuild) -> tuple[Table, Placement]:
        config, param = build.config, build.params[name]
        table = ShardedTable(
            name, param, num_partitions=1, worker=build.worker, group=build.group,
            traffic=build.traffic, sparse_grad=_sparse_grad(use, config),
            average=config.average_sparse, first_server=build.owners[name],
            initial_rows=_initial_rows(param), steps=build.layout.steps,
            divides_on_arrival=_divides_on_arrival(config))
        table.sharding = POOLED
        return table, Placement("ps", 1, (build.servers[build.owners[name]],))


class PooledByColumnsKind(TableKind):
    """Held as column slices, one per server (`parallax.engine.tables.sharding.PooledByColumns`)."""

    def build(self, name: str, use: SparseUse, build: LayoutBuild) -> tuple[Table, Placement]:
        table = _column_table(name, build.params[name], build.by_columns.index(name),
                              config=build.config, worker=build.worker, group=build.group,
                              traffic=build.traffic,
                              sparse_grad=_sparse_grad(use, build.config),
                              steps=build.layout.steps)
        slices, partitioning = table.sharding.slices, table.partitioning
        return table, Placement("ps", slices, tuple(
            build.servers[partitioning.server_of_partition(k)] for k in range(slices)))


class ReplicatedKind(TableKind):
    """A replica on every worker (`parallax.engine.tables.sharding.Replicated`): the
    architecture keeps sparse parameters off the servers."""

    scattered = False  # (every worker keeps the program's copy: it is the replica)

    def build(self, name: str, use: SparseUse, build: LayoutBuild) -> tuple[Table, Placement]:
        config = build.config
        return ReplicatedTable(
            name, build.params[name], worker=build.worker, group=build.group,
            traffic=build.traffic, sparse_grad=_sparse_grad(use, config),
            average=config.average_sparse, batch_dependent=use.batch_dependent,
            steps=build.layout.steps), Placement("allgatherv", 0, ())


#: every kind by its name (the sharding's, `Config.sharding`'s word), and the replica's
TABLE_KINDS: dict[str, TableKind] = {
    ShardingName.ROWS: RowsPulledKind(), ShardingName.POOLED: PooledWholeKind(),
    ShardingName.POOLED_BY_ROWS: PooledByRowsKind(),
    ShardingName.POOLED_BY_COLUMNS: PooledByColumnsKind(), REPLICATED_KIND: ReplicatedKind()}


def _kind_name(name: str, pins: dict[str, tuple[ShardingName, str]],
               architecture: Architecture) -> str:
    """Table ``name``'s kind: the pooled kind the program pins it to (pooling wins over the
    architecture: the owners hold the bags), else rows on the servers or a replica, as the
    architecture keeps sparse parameters."""
    pinned = pins.get(name)
    if pinned is not None and pinned[0] != ShardingName.ROWS:
        if pinned[0] == ShardingName.POOLED_BY_ROWS and not architecture.sparse_on_servers:
            return REPLICATED_KIND
        return pinned[0]
    return ShardingName.ROWS if architecture.sparse_on_servers else REPLICATED_KIND


def build_layout(model: nn.Module, sparse_uses: dict[str, SparseUse], *, config: Config,
                 worker: WorkerInfo, group: dist.ProcessGroup, traffic: Traffic,
                 optimizers: Sequence[torch.optim.Optimizer] = ()) -> Layout:
    """Create the tables (collective: initial values come from rank 0), each by its kind
    (`TABLE_KINDS`). Each server-held table's storage in the program's model, and the state
    ``optimizers`` hold for it, go as soon as the table is scattered (`Layout.user_state`
    keeps this server's rows of that state for the servers' optimizer): a lower peak for a
    model built as usual."""
    architecture = architecture_of(config)
    params = dict(model.named_parameters())
    layout = Layout()
    pins = _pins(sparse_uses, config)
    build = LayoutBuild(model, config, worker, group, traffic, layout, architecture, params,
                        optimizers)
    kinds = {name: _kind_name(name, pins, architecture) for name in sorted(sparse_uses)}
    build.owners = pooled_owners(sparse_uses, params, pins, len(worker.server_ranks))
    build.by_columns = [name for name, kind in kinds.items()
                        if kind == ShardingName.POOLED_BY_COLUMNS]
    for name, (pinned, field_) in pins.items():  # (the pin's own rule, whatever it becomes)
        TABLE_KINDS[pinned].check(name, sparse_uses[name], build, field_)
    for name, kind_name in kinds.items():
        kind = TABLE_KINDS[kind_name]
        if kind.scattered:
            _drop_unread_copy(params[name], name, worker)
        table, layout.placements[name] = kind.build(name, sparse_uses[name], build)
        layout.add(table)
        if kind.scattered:
            _hand_over_early(layout, table, params[name], optimizers, worker)
    if architecture.dense_on_servers:
        dense = {n: p for n, p in params.items() if p.requires_grad and n not in sparse_uses}
        aggregates = architecture.aggregates_locally(config)
        servers = worker.server_ranks
        for name, server in greedy_placement(dense, layout.sparse, len(servers)).items():
            weight = params[name].detach()
            layout.pulled_whole[name] = ShardedTable(
                name, weight.reshape(1) if weight.dim() == 0 else weight, num_partitions=1,
                worker=worker, group=group, traffic=traffic, sparse_grad=False,
                average=config.average_dense, local_aggregation=aggregates,
                first_server=server, initial_rows=_initial_rows(params[name]),
                steps=layout.steps, divides_on_arrival=_divides_on_arrival(config))
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
        initial_rows=None if recipe is None else slices_of_rows(recipe, slices), steps=steps,
        divides_on_arrival=_divides_on_arrival(config))
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


