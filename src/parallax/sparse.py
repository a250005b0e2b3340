"""Parameters on parameter servers: row partitioning, pull of rows, push of gradient rows.

One ``ShardedTable`` per server-held parameter. Its rows are split into partitions by
``id % P`` (Zipf-hot ids, which are small numbers, spread over all partitions); partition ``p``
lives on server ``(p + first_server) % S``, and a server keeps all its partitions in one tensor,
its *shard*. A dense parameter under the ``ps`` architecture is a table with one partition whose
every row is pulled each step.

With local aggregation the workers of one machine first send their ids to the machine's first
worker (its leader, co-located with its server), which merges them, pulls each row once for the
whole machine and fans the rows out; gradients go the same way back, summed per row by the
leader before anything crosses machines.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from parallax.cluster import WorkerInfo
from parallax.exchange import Hop, SparseIdError, Traffic, unique_ids

__all__ = ["RowPartitioning", "ShardedTable", "SparseIdError"]


class RowPartitioning:
    """Where each row of a ``num_rows``-row table lives: owning rank and row inside its shard."""

    def __init__(self, num_rows: int, num_partitions: int, server_ranks: tuple[int, ...],
                 first_server: int = 0):
        self.num_rows = num_rows
        self.num_partitions = num_partitions
        self.server_ranks = server_ranks
        self.first_server = first_server
        sizes = [max(0, (num_rows - p + num_partitions - 1) // num_partitions)
                 for p in range(num_partitions)]
        owners, offsets = [], []
        self.shard_rows = [0] * len(server_ranks)
        for p, size in enumerate(sizes):
            server = self.server_of_partition(p)
            owners.append(server_ranks[server])
            offsets.append(self.shard_rows[server])
            self.shard_rows[server] += size
        self._owner_of_partition = torch.tensor(owners, dtype=torch.long)
        self._offset_of_partition = torch.tensor(offsets, dtype=torch.long)

    def server_of_partition(self, partition: int) -> int:
        return (partition + self.first_server) % len(self.server_ranks)

    def owner_rank(self, ids: Tensor) -> Tensor:
        return self._owner_of_partition.to(ids.device)[ids % self.num_partitions]

    def local_row(self, ids: Tensor) -> Tensor:
        offsets = self._offset_of_partition.to(ids.device)
        return offsets[ids % self.num_partitions] + ids // self.num_partitions

    def rows_of_server(self, server_index: int) -> Tensor:
        """Global ids held by one server, in the order of its shard."""
        parts = [torch.arange(p, max(p, self.num_rows), self.num_partitions)
                 for p in range(self.num_partitions)
                 if self.server_of_partition(p) == server_index]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)


@dataclass
class _DirectRoute:
    """How unique ids travelled to their owners, so that gradients follow them."""

    order: Tensor            # permutation sorting the ids by owner rank
    hop: Hop
    recv_local_rows: Tensor  # on a server: the shard rows the received ids address


@dataclass
class _Lookup:
    ids: Tensor                     # this worker's unique ids
    rows: Tensor                    # leaf [unique ids, *row]; its .grad is what gets pushed
    direct: _DirectRoute            # worker -> owners (or leader -> owners when aggregating)
    to_leader: Hop | None = None    # worker -> its machine's leader (local aggregation)
    merged_inverse: Tensor | None = None  # at the leader: received piece -> merged row
    merged_count: int = 0


class ShardedTable:
    """One parameter held by the servers; a collective object (every rank calls it)."""

    def __init__(self, name: str, weight: Tensor, *, num_partitions: int, worker: WorkerInfo,
                 group: dist.ProcessGroup, traffic: Traffic, sparse_grad: bool, average: bool,
                 local_aggregation: bool = False, first_server: int = 0):
        if weight.dim() < 1:
            raise ValueError(f"parameter '{name}' must have rows (dim >= 1), got a scalar")
        self.name = name
        self.num_rows = weight.shape[0]
        self.row_shape = tuple(weight.shape[1:])
        self.dtype = weight.dtype
        self.device = weight.device
        self.worker = worker
        self.group = group
        self.traffic = traffic
        self.sparse_grad = sparse_grad
        self.average = average
        self.local_aggregation = local_aggregation and worker.world_size > 1
        self.partitioning = RowPartitioning(self.num_rows, num_partitions, worker.server_ranks,
                                            first_server)
        self.shard: nn.Parameter | None = None
        self.rows_used: list[int] = []          # per training step, this worker's rows
        self.machine_rows_used: list[int] = []  # per step at a leader: its machine's rows
        self._pending: list[_Lookup] = []
        self._sparse_pieces: list[tuple[Tensor, Tensor]] = []
        # Rank 0's initial values are the model's, whatever the other ranks' seeds were.
        initial = weight.detach().clone()
        dist.broadcast(initial, src=0, group=group)
        if worker.is_server:
            mine = self.partitioning.rows_of_server(worker.server_ranks.index(worker.rank))
            self.shard = nn.Parameter(initial[mine.to(initial.device)].clone())

    @property
    def _leader(self) -> int:
        return self.worker.server_ranks[self.worker.machine]

    def _rows(self, count: int) -> Tensor:
        return torch.empty((count, *self.row_shape), dtype=self.dtype, device=self.device)

    def _open(self, send_counts: list[int], bad_id: int | None = None) -> Hop:
        return Hop.open(send_counts, group=self.group, traffic=self.traffic, name=self.name,
                        num_rows=self.num_rows, bad_id=bad_id, device=self.device)

    # ---- forward: pull -------------------------------------------------------------------
    def lookup(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """Pull the rows ``ids`` needs. Returns ``(rows, inverse)`` with ``rows[inverse]`` the
        looked-up values; ``rows`` is a leaf whose gradient `push_gradients` sends back."""
        unique, inverse, bad_id = unique_ids(ids, self.num_rows, self.name, self.worker.rank)
        if self.local_aggregation:
            lookup = self._pull_via_leader(unique, bad_id)
        else:
            rows, direct = self._pull_direct(unique, bad_id)
            lookup = _Lookup(unique, rows, direct)
        if torch.is_grad_enabled():
            lookup.rows.requires_grad_(True)
            self._pending.append(lookup)
        return lookup.rows, inverse

    def _pull_direct(self, unique: Tensor, bad_id: int | None,
                     source: Tensor | None = None) -> tuple[Tensor, _DirectRoute]:
        """Rows ``unique`` from their owners' shards (or from ``source``, a tensor shaped
        like the shard, e.g. an optimizer state)."""
        owner = self.partitioning.owner_rank(unique.clamp(0, max(self.num_rows - 1, 0)))
        order = torch.argsort(owner, stable=True)
        hop = self._open(torch.bincount(owner, minlength=self.worker.world_size).tolist(),
                         bad_id)
        recv_ids = hop.forward(unique[order])
        local = self.partitioning.local_row(recv_ids)
        held = source if source is not None else self.shard
        served = held.detach()[local] if held is not None else self._rows(0)
        rows = self._rows(unique.numel())
        rows[order] = hop.backward(served)
        return rows, _DirectRoute(order, hop, local)

    def _pull_via_leader(self, unique: Tensor, bad_id: int | None) -> _Lookup:
        counts = [0] * self.worker.world_size
        counts[self._leader] = unique.numel()
        to_leader = self._open(counts, bad_id)
        pieces = to_leader.forward(unique)  # at a leader: every local worker's ids
        merged, merged_inverse = torch.unique(pieces, return_inverse=True)
        merged_rows, direct = self._pull_direct(merged, None)
        rows = to_leader.backward(merged_rows[merged_inverse])
        return _Lookup(unique, rows, direct, to_leader, merged_inverse, merged.numel())

    def read_rows(self, ids: Tensor, source: Tensor | None = None) -> Tensor:
        """Current values of rows ``ids`` (collective; for export and migration), from the
        shards or from ``source``, a tensor each server holds shaped like its shard."""
        with torch.no_grad():
            unique, inverse = torch.unique(ids.reshape(-1), return_inverse=True)
            rows, _ = self._pull_direct(unique, None, source)
        return rows[inverse].view(*ids.shape, *self.row_shape)

    # ---- backward: push ------------------------------------------------------------------
    def zero_grad(self) -> None:
        self._pending.clear()
        self._sparse_pieces.clear()
        if self.shard is None:
            return
        if self.sparse_grad:
            self.shard.grad = None
        elif self.shard.grad is None:
            self.shard.grad = torch.zeros_like(self.shard)
        else:
            self.shard.grad.zero_()

    def push_gradients(self) -> None:
        """Send each lookup's gradient rows to their servers (collective, in lookup order);
        servers sum the rows of all workers and, by default, divide by the worker count."""
        self._record_usage()
        for lookup in self._pending:
            grad = lookup.rows.grad
            if grad is None:
                grad = torch.zeros_like(lookup.rows)
            if lookup.to_leader is not None:
                pieces = lookup.to_leader.forward(grad)
                grad = self._rows(lookup.merged_count).zero_()
                grad.index_add_(0, lookup.merged_inverse, pieces)
            route = lookup.direct
            received = route.hop.forward(grad[route.order])
            if self.shard is not None:
                if self.average:
                    received.div_(self.worker.world_size)
                self._accumulate(route.recv_local_rows, received)
        self._pending.clear()
        self._finish_sparse_grad()

    def _record_usage(self) -> None:
        if not self._pending:
            return
        ids = torch.cat([lookup.ids for lookup in self._pending])
        self.rows_used.append(int(torch.unique(ids).numel()))
        if self.local_aggregation and self.worker.rank == self._leader:
            self.machine_rows_used.append(sum(lookup.merged_count for lookup in self._pending))

    def _accumulate(self, local_rows: Tensor, grad_rows: Tensor) -> None:
        if self.sparse_grad:
            self._sparse_pieces.append((local_rows, grad_rows))
        else:
            self.shard.grad.index_add_(0, local_rows, grad_rows)

    def _finish_sparse_grad(self) -> None:
        if self.shard is None or not self.sparse_grad:
            return
        if self._sparse_pieces:
            rows = torch.cat([rows for rows, _ in self._sparse_pieces])
            values = torch.cat([values for _, values in self._sparse_pieces])
        else:
            rows = torch.empty(0, dtype=torch.long, device=self.device)
            values = self._rows(0)
        grad = torch.sparse_coo_tensor(rows.unsqueeze(0), values, self.shard.shape,
                                       check_invariants=False)
        self.shard.grad = grad.coalesce()
        self._sparse_pieces.clear()

    def grad_norm_squared(self) -> Tensor:
        """This server's part of the squared global gradient norm (0 on non-servers): computed
        where the aggregated gradient lives, so only a scalar travels."""
        grad = None if self.shard is None else self.shard.grad
        if grad is None:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        values = grad._values() if grad.is_sparse else grad
        return torch.linalg.vector_norm(values, dtype=torch.float64) ** 2

    def scale_grad(self, factor: Tensor) -> None:
        if self.shard is not None and self.shard.grad is not None:
            self.shard.grad.mul_(factor.to(self.dtype))

    def full_weight(self, source: Tensor | None = None) -> Tensor:
        """The whole table (or a shard-shaped ``source``), gathered from the servers
        (collective)."""
        return self.read_rows(torch.arange(self.num_rows, device=self.device), source)
