"""Measured sparsity, and moving a sparse parameter whose rows are mostly used to AllReduce.

α of a sparse parameter is the average fraction of its rows one worker uses per step, measured
on the real batches of the first training steps; α_m the same for the union of one machine's
workers (what a machine pulls under local aggregation). Under the hybrid architecture a
parameter whose α is above the threshold moves, values and optimizer state, from the servers to
replicas whose dense gradient is AllReduced: past that point it costs fewer bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from parallax.cluster import WorkerInfo
from parallax.collective import agree
from parallax.engine.optimizers.replica_rows import param_group_of
from parallax.engine.optimizers.shard_optimizer import (
    ShardOptimizer,
    is_per_row,
    optimizer_of,
    zero_gradient_is_identity,
)
from parallax.engine.tables import lookup_options
from parallax.engine.tables.handles import restore
from parallax.engine.tables.own import OwnTable
from parallax.engine.tables.own_summed import SummedOwnTable
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


#: the plan's reason for a table that is the program's own (`OwnTable`)
OWN = ("one worker: no exchange, the program's own parameter (its layer reads it, autograd "
       "writes its gradient, the optimizer steps it whole)")

#: The most elements of a table whose whole step (autograd's zero-filled gradient, the
#: optimizer over every row) costs no more than the touched rows' own machinery (dedup,
#: gradient sum, row update: a fixed few dozen operators). Measured on the benchmark LM at one
#: worker with Adagrad, on this project's 2-core CPU host: a whole 2,000 x 16 table stepped in
#: 1.07 ms against 1.47 ms by rows, 20,000 x 16 in 3.2-5.9 ms against 1.6-2.0 ms, 200,000 x 16
#: in 23 ms against 1.7 ms. On a GPU each pass over the table is ~500x faster (bandwidth)
#: while the rows' machinery costs as many launches: modelled, not yet measured there.
WHOLE_STEP_ELEMENTS = {"cpu": 2**16, "cuda": 2**24}


def own_table_chosen(param: nn.Parameter, optimizers: Sequence[torch.optim.Optimizer], *,
                     device: torch.device, world_size: int, sparse_grad: bool,
                     batch_dependent: lookup_options.BatchDependent | None) -> bool:
    """Whether a table replicated on a world of one is the program's own parameter: a
    dense-gradient layer whose options do not read the batch (those keep the replica's
    exchange, which implements them over the global batch), and either small enough that its
    whole step is cheap (`WHOLE_STEP_ELEMENTS`) or stepped by an optimizer that moves every
    row each step anyway (momentum, weight decay, Adam's moments: a zero gradient's step is
    not the identity). ``device``: the run's (``param`` may be a released handle). Either
    choice is exact; this one is about cost."""
    if world_size != 1 or sparse_grad or batch_dependent is not None:
        return False
    if param.numel() <= WHOLE_STEP_ELEMENTS.get(device.type, WHOLE_STEP_ELEMENTS["cpu"]):
        return True
    owner = param_group_of(param, optimizers)
    return owner is None or not zero_gradient_is_identity(*owner)  # (None: nothing steps it)


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
    if own_table_chosen(param, optimizers, device=worker.device, world_size=worker.world_size,
                        sparse_grad=table.sparse_grad, batch_dependent=table.batch_dependent):
        return OwnTable(table.name, param, worker=worker)
    if worker.world_size > 1 and not table.sparse_grad and table.batch_dependent is None:
        # the layer's own read, its dense gradient summed as DDP sums a dense one
        return SummedOwnTable(table.name, param, worker=worker, group=group,
                              traffic=table.traffic, average=table.average)
    # SparseAdam needs sparse gradients; one worker gathers nothing either way, and the rows
    # a step touched are all it updates (an AllReduced table's update reads every row, many
    # times the step of the rows alone)
    sync = "allgatherv" if table.sparse_grad or worker.world_size == 1 else "allreduce"
    return ReplicatedTable(table.name, param, worker=worker, group=group, traffic=table.traffic,
                           sparse_grad=table.sparse_grad, average=table.average, sync=sync,
                           batch_dependent=table.batch_dependent, steps=table.steps)

