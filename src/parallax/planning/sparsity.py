"""Measured sparsity, and moving a sparse parameter whose rows are mostly used to AllReduce.

α of a sparse parameter is the average fraction of its rows one worker uses per step, measured
on the real batches of the first training steps; α_m the same for the union of one machine's
workers (what a machine pulls under local aggregation). Under the hybrid architecture a
parameter whose α is above the threshold moves, values and optimizer state, from the servers to
replicas whose dense gradient is AllReduced: past that point it costs fewer bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from parallax.cluster import WorkerInfo
from parallax.collective import agree
from parallax.engine.optimizers.shard_optimizer import ShardOptimizer, is_per_row, optimizer_of
from parallax.engine.tables import own
from parallax.engine.tables.handles import restore
from parallax.engine.tables.replicated import ReplicatedTable
from parallax.engine.tables.server_table import ShardedTable
from parallax.engine.tables.table import Table


@dataclass(frozen=True)
class Sparsity:
    alpha: float                  # rows one worker uses per step / rows
    alpha_machine: float | None   # rows one machine uses per step / rows (local aggregation)
    #: an nn.EmbeddingBag's ids and bags per worker and step (None: no bag calls)
    bag_ids: float | None = None
    bags: float | None = None
    #: some worker's bag call had per-sample weights that require a gradient
    weights_need_grad: bool = False
    #: an ``nn.Embedding``'s rows were used otherwise than summed or averaged over bags on
    #: some worker (`parallax.model.bag_reductions`; its bags are then not counted)
    rows_read_otherwise: bool = False


def measure(tables: dict[str, Table], worker: WorkerInfo,
            group: dist.ProcessGroup, device: torch.device) -> dict[str, Sparsity]:
    """α and α_m of every table from its recorded usage (collective)."""
    names = sorted(tables)
    values = torch.zeros(len(names), 6, dtype=torch.float64, device=device)
    for i, name in enumerate(names):
        table = tables[name]
        if table.rows_used:
            steps = len(table.rows_used)
            values[i, 0] = sum(table.rows_used) / steps / table.num_rows
            values[i, 2] = table.bag_use.ids / steps
            values[i, 3] = table.bag_use.bags / steps
        values[i, 4] = float(table.bag_use.weights_need_grad)
        values[i, 5] = float(table.bag_use.rows_read_otherwise)
        if table.machine_rows_used:
            used = table.machine_rows_used
            values[i, 1] = sum(used) / len(used) / table.num_rows
    dist.all_reduce(values, group=group)
    values = values.cpu()
    machines = len(worker.server_ranks)
    result = {}
    for i, name in enumerate(names):
        aggregated = tables[name].on_servers and tables[name].local_aggregation
        otherwise = bool(values[i, 5] > 0)
        bags = 0.0 if otherwise else float(values[i, 3]) / worker.world_size
        result[name] = Sparsity(
            float(values[i, 0]) / worker.world_size,
            float(values[i, 1]) / machines if aggregated else None,
            float(values[i, 2]) / worker.world_size if bags else None, bags or None,
            bool(values[i, 4] > 0), otherwise)
    return result


def move_to_allreduce(table: ShardedTable, param: nn.Parameter,
                      optimizers: list[torch.optim.Optimizer], shard_optimizer: ShardOptimizer,
                      *, worker: WorkerInfo, group: dist.ProcessGroup) -> Table:
    """Bring ``param``'s values and optimizer state back from the servers into the replica on
    every worker (collective); the user's optimizer updates it from now on."""
    restore(param, table.full_weight())  # the user's copy was released (engine.handles)
    state = shard_optimizer.remove_table(table) if table.shard is not None else {}
    # Rank 0 is always a server: it tells everyone which entries are per-row tensors.
    layout = agree({key: ("rows" if is_per_row(value, table.shard) else value)
                    for key, value in state.items()}, rank=worker.rank, group=group)
    moved: dict[str, object] = {}
    for key, kind in layout.items():
        if isinstance(kind, str) and kind == "rows":
            moved[key] = table.full_weight(state.get(key)).view_as(param).clone()
        else:
            moved[key] = kind.clone() if isinstance(kind, Tensor) else kind
    owner = optimizer_of(optimizers, param)
    if owner is not None:
        owner.state[param] = moved
    # SparseAdam needs sparse gradients; one worker gathers nothing either way, and the rows
    # a step touched are all it updates (an AllReduced table's update reads every row, many
    # times the step of the rows alone)
    if own.eligible(world_size=worker.world_size, sparse_grad=table.sparse_grad,
                    batch_dependent=table.batch_dependent):
        return own.OwnTable(table.name, param, worker=worker)
    sync = "allgatherv" if table.sparse_grad or worker.world_size == 1 else "allreduce"
    return ReplicatedTable(table.name, param, worker=worker, group=group, traffic=table.traffic,
                           sparse_grad=table.sparse_grad, average=table.average, sync=sync,
                           batch_dependent=table.batch_dependent)

