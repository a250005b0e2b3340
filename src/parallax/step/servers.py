"""The hand-over to the parameter servers at start-up: the servers' optimizer over their shards
(`parallax.engine.optimizers.shard_optimizer`) takes the state the user's optimizer had for the
server-held parameters, and the user's copies are released (`parallax.engine.tables.handles`): they
would be stale full tables in every process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from parallax.cluster import WorkerInfo
from parallax.engine.optimizers.shard_optimizer import ShardOptimizer
from parallax.engine.tables.handles import release
from parallax.engine.tables.pool import PartitionPool
from parallax.engine.tables.table import Table, held_tables
from parallax.model.meta_init import forget

__all__ = ["hand_over"]


def hand_over(tables: dict[str, Table], params: dict[str, nn.Parameter],
              optimizers: Sequence[torch.optim.Optimizer], pool: PartitionPool, *,
              worker: WorkerInfo, taken: dict[str, dict[str, Any]] | None = None,
              ) -> ShardOptimizer:
    """The servers' optimizer of ``tables`` (by parameter name), run on ``pool``'s threads,
    with the user's state adopted (``taken``: what was taken of it already, by name; emptied)
    and the user's server-held parameters released."""
    taken = {} if taken is None else taken
    for table in tables.values():
        table.pool = pool
    held = held_tables(tables)
    # the state taken already is held from the start (no constructor-made state beside it)
    ready = {name: state for name, state in taken.items()
             if name in held and state and held[name].shard is not None}
    shard_optimizer = ShardOptimizer(optimizers, {
        id(params[name]): table for name, table in held.items() if table.shard is not None},
        pool, states=ready)
    for name, table in held.items():
        param = params[name]
        state = taken.pop(name, None)
        if name not in ready:
            shard_optimizer.adopt_user_state(table, param, optimizers, state)
        release(param, name=name, device=worker.device, rank=worker.rank)
        forget(param)  # a meta_init recipe, replayed by the servers already
    return shard_optimizer
