"""Which parameter is synchronised how, per `Config.architecture`.

| architecture | dense parameters | sparse parameters |
|---|---|---|
| hybrid (default) | replicated, AllReduce (DDP) | servers, local aggregation |
| allreduce | replicated, AllReduce (DDP) | replicated, AllGatherv of (ids, rows) |
| ps | servers, whole parameter on one server | servers |
| optps | as ps | as ps, local aggregation |
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch.distributed as dist
from torch import nn

from parallax.cluster import WorkerInfo
from parallax.config import Config
from parallax.engine.exchange import Traffic
from parallax.engine.replicated import ReplicatedTable
from parallax.engine.server_table import ShardedTable
from parallax.model.detect import SparseUse

Table = ShardedTable | ReplicatedTable


@dataclass
class Layout:
    """The tables of one run: sparse ones (read by lookups) and, under ps/optps, dense ones
    (pulled whole each step); plus each non-DDP parameter's (sync, partitions, servers)."""

    sparse: dict[str, Table] = field(default_factory=dict)
    dense: dict[str, ShardedTable] = field(default_factory=dict)
    placements: dict[str, tuple[str, int, tuple[int, ...]]] = field(default_factory=dict)

    @property
    def uses_ddp(self) -> bool:
        return not self.dense

    def all_tables(self) -> dict[str, Table]:
        return {**self.sparse, **self.dense}


def server_held(model: nn.Module, sparse_uses: dict[str, SparseUse],
                config: Config) -> dict[str, nn.Parameter]:
    """The parameters whose updates the servers apply (with the user's optimizer, per shard)."""
    if config.architecture == "allreduce":
        return {}
    params = dict(model.named_parameters())
    if config.architecture == "hybrid":
        return {name: params[name] for name in sparse_uses}
    return {name: p for name, p in params.items() if p.requires_grad}


def build_layout(model: nn.Module, sparse_uses: dict[str, SparseUse], *, config: Config,
                 worker: WorkerInfo, group: dist.ProcessGroup, traffic: Traffic) -> Layout:
    """Create the tables (collective: initial values come from rank 0)."""
    params = dict(model.named_parameters())
    layout = Layout()
    servers = worker.server_ranks
    num_partitions = config.num_partitions or len(servers)
    for name, use in sorted(sparse_uses.items()):
        if config.architecture == "allreduce":
            layout.sparse[name] = ReplicatedTable(
                name, params[name], worker=worker, group=group, traffic=traffic,
                sparse_grad=use.sparse_grad or config.lazy_sparse_updates,
                average=config.average_sparse, batch_dependent=use.batch_dependent)
            layout.placements[name] = ("allgatherv", 0, ())
        else:
            layout.sparse[name] = ShardedTable(
                name, params[name], num_partitions=num_partitions, worker=worker, group=group,
                traffic=traffic, sparse_grad=use.sparse_grad or config.lazy_sparse_updates,
                average=config.average_sparse, local_aggregation=config.aggregates_locally,
                batch_dependent=use.batch_dependent)
            layout.placements[name] = ("ps", num_partitions, servers)
    if config.architecture in ("ps", "optps"):
        dense = {n: p for n, p in params.items() if p.requires_grad and n not in sparse_uses}
        for name, server in greedy_placement(dense, layout.sparse, len(servers)).items():
            weight = params[name].detach()
            layout.dense[name] = ShardedTable(
                name, weight.reshape(1) if weight.dim() == 0 else weight, num_partitions=1,
                worker=worker, group=group, traffic=traffic, sparse_grad=False,
                average=config.average_dense, local_aggregation=config.aggregates_locally,
                first_server=server)
            layout.placements[name] = ("ps", 1, (servers[server],))
    return layout


def greedy_placement(dense: dict[str, nn.Parameter], sparse: dict[str, Table],
                     num_servers: int) -> dict[str, int]:
    """Each dense parameter whole on one server: largest first, onto the server holding the
    fewest bytes so far (sparse shards included)."""
    load = [0] * num_servers
    for table in sparse.values():
        if isinstance(table, ShardedTable):
            row_bytes = table.dtype.itemsize * math.prod(table.row_shape)
            for server, rows in enumerate(table.partitioning.shard_rows):
                load[server] += rows * row_bytes
    placement = {}
    by_size = sorted(dense.items(), key=lambda item: (-item[1].nbytes, item[0]))
    for name, param in by_size:
        server = min(range(num_servers), key=lambda s: (load[s], s))
        placement[name] = server
        load[server] += param.nbytes
    return placement

