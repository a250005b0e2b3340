"""Changing a server-held table's partition count in process, values and optimizer state kept.

Every server computes which rows its shard holds under the new count, and reads those rows
(and each per-row optimizer-state tensor) from the old shards with the table's own pull; then
the table switches to the new partitioning and the server optimizer to the new shard. Training
goes on exactly as before: only where rows live has changed. `to_column_slices` cuts a table
into column slices the same way (`parallax.engine.tables.columns`): each server of a slice
reads every row and keeps its slice's columns.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from parallax.collective import agree
from parallax.engine.optimizers.shard_optimizer import ShardOptimizer, is_per_row
from parallax.engine.tables import server_table
from parallax.engine.tables.server_table import RowPartitioning, ShardedTable
from parallax.engine.tables.sharding import PooledByColumns
from parallax.errors import ArgumentError, InternalError

__all__ = ["repartition", "to_column_slices"]


def repartition(table: ShardedTable, num_partitions: int,
                shard_optimizer: ShardOptimizer, *, first_server: int | None = None) -> None:
    """Re-partition ``table`` into ``num_partitions`` (collective over all ranks); partition
    0 onto server ``first_server`` (an index into the server ranks; default: where it is)."""
    if not 1 <= num_partitions <= max(table.num_rows, 1):
        raise ArgumentError(f"parameter '{table.name}': num_partitions must be in "
                         f"[1, {table.num_rows}] (its rows), got {num_partitions}")
    worker = table.worker
    new = RowPartitioning(table.num_rows, num_partitions, worker.server_ranks,
                          table.partitioning.first_server if first_server is None
                          else first_server)
    mine = (new.rows_of_server(worker.server_ranks.index(worker.rank)) if worker.is_server
            else torch.empty(0, dtype=torch.long)).to(table.device)

    def switch() -> None:
        table.partitioning = new
    _move(table, shard_optimizer, mine, switch)


def to_column_slices(table: ShardedTable, slices: int, shard_optimizer: ShardOptimizer, *,
                     first_server: int = 0) -> None:
    """Hold ``table`` (whole rows, any partitioning) as ``slices`` column slices, slice k on
    server ``first_server + k`` (collective over all ranks), values and optimizer state kept:
    each server of a slice reads every row, a round at a time, and keeps its columns."""
    width = math.prod(table.row_shape)
    if slices < 2 or width % slices or slices > len(table.worker.server_ranks):
        raise InternalError(f"'{table.name}': {slices} column slices of rows of {width} "
                            f"over {len(table.worker.server_ranks)} servers; please report it")
    worker = table.worker
    new = RowPartitioning(table.num_rows * slices, slices, worker.server_ranks, first_server)
    index = worker.server_ranks.index(worker.rank) if worker.is_server else -1
    mine = [k for k in range(slices) if new.server_of_partition(k) == index]
    ids = torch.arange(table.num_rows if mine else 0, device=table.device)

    def keep(rows: Tensor) -> Tensor:  # this server's slice of whole rows
        return rows.reshape(rows.shape[0], slices, width // slices)[:, mine[0] if mine else 0]

    def switch() -> None:
        table.num_rows, table.row_shape = table.num_rows * slices, (width // slices,)
        table.sharding = PooledByColumns(slices)
        table.partitioning = new
    _move(table, shard_optimizer, ids, switch, keep=keep)


def _move(table: ShardedTable, shard_optimizer: ShardOptimizer, ids: Tensor,
          switch: Callable[[], None], *, keep: Callable[[Tensor], Tensor] | None = None) -> None:
    """Read this rank's rows ``ids`` (what ``keep`` keeps of each) and their per-row
    optimizer state from ``table`` as it is held, ``switch()`` it to where its rows go, and
    hold what was read as this server's shard (collective over all ranks)."""
    worker = table.worker
    old_shard, old_parts = table.shard, list(table.parts)
    if old_shard is not None:  # the moved table starts without gradient: free it first
        old_shard.grad = None  # (its partitions' gradients may view it)
        for part in table.parts:
            part.grad = None
    state = shard_optimizer.table_state(table) if old_shard is not None else {}
    old_state = shard_optimizer.per_row_state(table) if old_shard is not None else []
    # Rank 0 is a server: its state's keys (and which are per-row) are everyone's.
    per_row = agree(sorted(key for key, value in state.items() if is_per_row(value, old_shard)),
                    rank=worker.rank, group=table.group)
    values = _read_in_rounds(table, ids, keep=keep)
    # Every rank has read its rows from the old shard (the rounds are collective, each
    # round's rows copied out before it ends): its memory goes before the state is read, so
    # the new owner never holds the old half, the whole table and its whole state at once.
    if old_shard is not None:
        _free([old_shard, *old_parts])
    moved = {key: _read_in_rounds(table, ids, state.get(key), keep=keep) for key in per_row}
    if old_shard is not None:  # likewise the old per-row state (the rebuild drops it)
        _free([*old_state, *(state[key] for key in per_row if key in state)])
    switch()
    table.reservations.reset()  # (on every rank: moving rows is collective)
    table.pooled_reservations.clear()
    if old_shard is None:
        return
    table.set_shard(nn.Parameter(values, requires_grad=old_shard.requires_grad))
    shard_optimizer.table_repartitioned(table, {
        key: moved.get(key, value) for key, value in state.items()}, owned=True)
    table.zero_grad()


def _free(tensors: list[Tensor]) -> None:
    """Release the memory of ``tensors`` while objects about to be dropped (the old
    partitions in the optimizer until its rebuild, the old state) still refer to them: each
    holds no rows from now on (its data swapped for an empty tensor of its dtype and row
    shape; its storage goes with the last tensor viewing it: pass every view). A read after
    is an index error, never stale values. (Not FSDP's ``untyped_storage().resize_(0)``: a
    view of a storage resized to nothing crashes the process when read.)"""
    for tensor in tensors:
        tensor.data = tensor.data.new_empty((0, *tensor.shape[1:]))


def _read_in_rounds(table: ShardedTable, ids: Tensor, source: Tensor | None = None, *,
                    keep: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """``table.read_rows(ids, source)`` (fresh storage), in rounds of at most
    `server_table.SCATTER_ROUND_BYTES` of the whole table, received straight into the
    result: moving a large table onto one owner holds no second copy of it beside the
    result. Every rank takes as many rounds (counted from the table's size). ``keep``: what
    of each round's rows is kept (all of them: None)."""
    rounds = max(1, math.ceil(table.num_rows * 8 * math.prod(table.row_shape)
                              / server_table.SCATTER_ROUND_BYTES))
    out: Tensor | None = None
    for k in range(rounds):
        start, stop = ids.numel() * k // rounds, ids.numel() * (k + 1) // rounds
        piece = table.read_rows(ids[start:stop], source)
        if keep is not None:
            piece = keep(piece)
        if out is None:
            out = piece.new_empty((ids.numel(), *piece.shape[1:]))
        out[start:stop] = piece
    if out is None:
        raise InternalError(f"'{table.name}': no round of its rows was read; please report it")
    return out
