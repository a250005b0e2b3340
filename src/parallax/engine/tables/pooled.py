"""Owner-side pooling: an ``nn.EmbeddingBag``'s bags pooled where its table lives.

The row path (`parallax.engine.tables.server_table.pull`) brings every row a bag reads to the
worker and sends every such row's gradient back. A table named in `Config.pooled_tables` is
held whole by one server (TorchRec's table-wise sharding) and its bags are pooled *there*:
each worker sends the owner its ids and offsets (and per-sample weights), the owner runs
``F.embedding_bag`` on its rows exactly as the worker's layer would, and sends back one pooled
vector per bag; after the backward each worker sends those vectors' gradients to the owner,
which runs the backward of its ``embedding_bag`` and adds the rows' gradients into its shard's
gradient like any pushed rows (averaged, clipped and updated by the servers' optimizer as
before). A bag of L ids costs one vector each way instead of up to L rows: the win of long bags
over big tables (a user's history); one-id bags gain nothing.

Exact: the owner computes what the layer computes on one device, for each worker's own call
(its offsets, ``mode``, ``padding_idx``, ``include_last_offset``, weights), on the rows of the
unique ids of all workers together, so the sum over workers of the rows' gradients is the
single-device gradient of the global batch. What depends on the whole batch (``max_norm``,
``scale_grad_by_freq``) and per-sample weights that require a gradient are not pooled
(refused where the table is pinned, see `parallax.planning.architectures`).

Each call is collective (every rank's layer calls it at the same point of its forward): a
header (counts and flags, to every rank, so a bad id or refused weights fail every rank
alike), the ids and offsets to the owner, the weights if any rank has some, the pooled rows
back; and one message per call with the gradients in the push.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from parallax.cluster import WorkerInfo
from parallax.engine.tables.exchange import Hop, Traffic
from parallax.engine.tables.partitioning import RowPartitioning
from parallax.errors import (
    ArgumentError,
    ArgumentTypeError,
    SparseIdError,
    UnsupportedProgramError,
)


class PoolingTable(Protocol):
    """What pooling needs of a server-held table
    (`parallax.engine.tables.server_table.ShardedTable` is one)."""

    name: str
    num_rows: int
    dtype: torch.dtype
    device: torch.device
    worker: WorkerInfo
    group: dist.ProcessGroup
    traffic: Traffic
    partitioning: RowPartitioning
    average: bool
    has_gradient: bool
    rows_used: list[int]
    pooled_calls: list[PooledCall]
    before_read: Callable[[Tensor | None], None] | None

    def server_shard(self) -> nn.Parameter: ...

    def _rows(self, count: int) -> Tensor: ...

    def _accumulate(self, local_rows: Tensor, grad_rows: Tensor) -> None: ...

__all__ = ["PooledCall", "PoolingTable", "owner_of", "pool", "push_pooled"]

# header flags, per sender
_BAD_ID = 1
_HAS_WEIGHTS = 2
_WEIGHTS_NEED_GRAD = 4
# header fields, per sender and receiver: ids, offsets, flags, bad id, bags
_IDS, _OFFSETS, _FLAGS, _BAD, _BAGS = range(5)
HEADER_BYTES = 5 * 8


@dataclass
class PooledCall:
    """One pooled ``embedding_bag`` call of a step, kept until its gradients are pushed."""

    out: Tensor                 # this rank's pooled rows (a leaf: its .grad is pushed)
    hop: Hop                    # owner -> workers; its backward carries the gradients back
    pooled: list[Tensor]        # at the owner: each worker's pooled rows, with their graph
    rows: Tensor | None         # at the owner: the leaf rows of all workers' unique ids
    local_rows: Tensor | None   # at the owner: where those rows are in the shard
    distinct_ids: int           # this rank's distinct ids (α's measurement)


def owner_of(table: PoolingTable) -> int:
    """The rank holding a pooled table (one partition, on one server)."""
    partitioning = table.partitioning
    return partitioning.server_ranks[partitioning.server_of_partition(0)]


def pool(table: PoolingTable, ids: Tensor, offsets: Tensor | None,
         per_sample_weights: Tensor | None, *, mode: str, padding_idx: int | None,
         include_last_offset: bool) -> Tensor:
    """``F.embedding_bag(ids, table, offsets, ...)`` computed on the table's owner: this rank's
    pooled rows (collective; see the module)."""
    name, rank, world = table.name, table.worker.rank, table.worker.world_size
    if ids.dtype not in (torch.int64, torch.int32):
        raise ArgumentTypeError(f"parameter '{name}' on rank {rank}: ids must be an integer "
                                f"tensor, got {ids.dtype}")
    if per_sample_weights is not None and per_sample_weights.dtype != table.dtype:
        raise ArgumentTypeError(f"parameter '{name}' on rank {rank}: per_sample_weights must "
                                f"have the table's dtype {table.dtype}, got "
                                f"{per_sample_weights.dtype} (torch refuses it on one device)")
    ids, offsets, per_sample_weights, include_last_offset = _as_flat(
        ids, offsets, per_sample_weights, include_last_offset)
    if per_sample_weights is not None and per_sample_weights.shape != ids.shape:
        raise ArgumentError(f"embedding_bag: If per_sample_weights ({per_sample_weights.shape}) "
                         f"is not None, then it must have the same shape as the input "
                         f"({ids.shape})")
    bags = max(offsets.numel() - (1 if include_last_offset else 0), 0)
    owner = owner_of(table)
    header = _exchange_header(table, ids, offsets, per_sample_weights, bags, owner)
    hop_in = _hop(table, send={owner: ids.numel() + offsets.numel()},
                  receive=(header[:, _IDS] + header[:, _OFFSETS]).tolist())
    received = hop_in.forward(torch.cat([offsets.long(), ids.long()]))
    weights = None
    if bool((header[:, _FLAGS] & _HAS_WEIGHTS).any()):
        mine = (per_sample_weights.detach() if per_sample_weights is not None
                else table._rows(0).new_empty(0))
        hop_w = _hop(table, send={owner: mine.numel()},
                     receive=[int(n) if int(f) & _HAS_WEIGHTS else 0
                              for n, f in zip(header[:, _IDS], header[:, _FLAGS], strict=True)])
        weights = hop_w.forward(mine)
    grad = torch.is_grad_enabled()
    pooled: list[Tensor] = []
    rows = local = None
    if rank == owner:
        pooled, rows, local = _pool_at_owner(table, header, received, weights, grad=grad,
                                             mode=mode, padding_idx=padding_idx,
                                             include_last_offset=include_last_offset)
        payload = torch.cat([p.detach() for p in pooled]) if pooled else table._rows(0)
    else:
        payload = table._rows(0)
    hop_out = _hop(table, send={w: int(n) for w, n in enumerate(header[:, _BAGS])}
                   if rank == owner else {}, receive=[bags if w == owner else 0
                                                     for w in range(world)])
    out = hop_out.forward(payload)
    if grad:
        out.requires_grad_(True)
        distinct = int(torch.unique(ids).numel())
        table.pooled_calls.append(PooledCall(out, hop_out, pooled, rows, local, distinct))
    return out


def _as_flat(ids: Tensor, offsets: Tensor | None, weights: Tensor | None,
             include_last_offset: bool) -> tuple[Tensor, Tensor, Tensor | None, bool]:
    """The call as 1-D ids with offsets, as ``F.embedding_bag`` itself turns a 2-D batch of
    fixed-length bags into one (same checks, same messages)."""
    if ids.dim() == 2:
        if offsets is not None:
            raise ArgumentError("if input is 2D, then offsets has to be None, as input is treated "
                             "is a mini-batch of fixed length sequences. However, found "
                             f"offsets of type {type(offsets)}")
        offsets = torch.arange(0, ids.numel(), ids.size(1), dtype=ids.dtype, device=ids.device)
        return ids.reshape(-1), offsets, (None if weights is None else weights.reshape(-1)), \
            False
    if ids.dim() != 1:
        raise ArgumentError(f"input has to be 1D or 2D Tensor, but got Tensor of dimension "
                         f"{ids.dim()}")
    if offsets is None or offsets.dim() != 1:
        raise ArgumentError("offsets has to be a 1D Tensor" + (" but got None" if offsets is None
                                                           else ""))
    return ids, offsets, weights, include_last_offset


def _exchange_header(table: PoolingTable, ids: Tensor, offsets: Tensor, weights: Tensor | None,
                     bags: int, owner: int) -> Tensor:
    """Every sender's counts (to the owner) and flags (to every rank); raises on every rank
    alike for a bad id or weights that need a gradient, naming the rank."""
    world = table.worker.world_size
    flags, bad = 0, 0
    if ids.numel():
        low, high = torch.aminmax(ids)
        if int(low) < 0 or int(high) >= table.num_rows:
            flags, bad = _BAD_ID, int(low) if int(low) < 0 else int(high)
    if weights is not None:
        flags |= _HAS_WEIGHTS | (_WEIGHTS_NEED_GRAD if weights.requires_grad else 0)
    message = torch.zeros(world, 5, dtype=torch.long)
    message[:, _FLAGS], message[:, _BAD] = flags, bad
    message[owner, _IDS], message[owner, _OFFSETS] = ids.numel(), offsets.numel()
    message[owner, _BAGS] = bags
    received = torch.empty_like(message)
    dist.all_to_all_single(received, message.to(table.device), group=table.group)
    received = received.cpu()
    table.traffic.record(table.name, [1] * world, [1] * world, HEADER_BYTES)
    sender_flags = received[:, _FLAGS]
    for peer in (sender_flags & _BAD_ID).nonzero().flatten().tolist():
        machine = table.traffic.machine_of_rank[peer]
        raise SparseIdError(f"parallax: sparse parameter '{table.name}' got id "
                            f"{int(received[peer, _BAD])} on rank {peer} (machine {machine}), "
                            f"outside its rows [0, {table.num_rows})")
    for peer in (sender_flags & _WEIGHTS_NEED_GRAD).nonzero().flatten().tolist():
        raise UnsupportedProgramError(
            f"rank {peer}: parameter '{table.name}' is pooled on its owner "
            "(Config.pooled_tables), but its per_sample_weights require a gradient, which "
            "owner-side pooling does not send back; leave the table out of pooled_tables "
            "(its rows are then pulled to the workers) or detach the weights")
    return received


def _hop(table: PoolingTable, *, send: dict[int, int], receive: list[int]) -> Hop:
    counts = [0] * table.worker.world_size
    for peer, count in send.items():
        counts[peer] = count
    return Hop({table.name: counts}, {table.name: [int(c) for c in receive]}, table.group,
               table.traffic)


def _pool_at_owner(table: PoolingTable, header: Tensor, received: Tensor,
                   weights: Tensor | None, *, grad: bool, mode: str, padding_idx: int | None,
                   include_last_offset: bool) -> tuple[list[Tensor], Tensor, Tensor]:
    """Each worker's call computed on the unique rows of all of them (with their graph)."""
    counts = header[:, _IDS].tolist()
    pieces = received.split((header[:, _IDS] + header[:, _OFFSETS]).tolist())
    calls = [(piece[:int(m)], piece[int(m):]) for piece, m in
             zip(pieces, header[:, _OFFSETS], strict=True)]
    unique, inverse = torch.unique(torch.cat([ids for _, ids in calls]), return_inverse=True)
    local = table.partitioning.local_row(unique)
    if table.before_read is not None:
        table.before_read(local)  # deferred steps first (values and optimizer state)
    rows = table.server_shard().detach()[local]
    if grad:
        rows.requires_grad_(True)
    padding = None
    if padding_idx is not None:
        target = padding_idx + table.num_rows if padding_idx < 0 else padding_idx
        hits = (unique == target).nonzero()
        padding = int(hits[0, 0]) if hits.numel() else None
    has_weights = (header[:, _FLAGS] & _HAS_WEIGHTS).tolist()
    weight_pieces = (weights.split([n if h else 0 for n, h in zip(counts, has_weights,
                                                                   strict=True)])
                     if weights is not None else [None] * len(counts))
    pooled = []
    for (offsets, _), positions, w, h in zip(calls, inverse.split(counts), weight_pieces,
                                             has_weights, strict=True):
        pooled.append(F.embedding_bag(positions, rows, offsets, mode=mode,
                                      per_sample_weights=w if h else None,
                                      include_last_offset=include_last_offset,
                                      padding_idx=padding))
    return pooled, rows, local


def push_pooled(tables: Sequence[PoolingTable]) -> None:
    """Send the gradients of every pooled call of this step to the tables' owners, which add
    their rows' gradients to the shard's (collective: every rank's calls in the same order)."""
    for table in tables:
        calls, table.pooled_calls = table.pooled_calls, []
        if not calls:
            continue
        table.has_gradient = table.has_gradient or any(c.out.grad is not None for c in calls)
        table.rows_used.append(sum(c.distinct_ids for c in calls))
        for call in calls:
            grad = call.out.grad if call.out.grad is not None else torch.zeros_like(call.out)
            received = call.hop.backward(grad)
            if call.rows is None or call.local_rows is None:
                continue  # not the owner
            bags = [p.shape[0] for p in call.pooled]
            torch.autograd.backward(call.pooled, list(received.split(bags)))
            rows_grad = call.rows.grad
            if rows_grad is None:
                continue
            if table.average:
                rows_grad.div_(table.worker.world_size)
            table._accumulate(call.local_rows, rows_grad)
