"""Sparse parameters on parameter servers: row partitioning, pull of rows, push of gradient rows.

One ``ShardedTable`` per sparse parameter. Its rows are split into partitions by ``id % P``
(Zipf-hot ids, which are small numbers, spread over all partitions); partition ``p`` lives on
server ``p % S``, and a server keeps all its partitions in one tensor, its *shard*.

Every exchange is one ``all_to_all_single`` over the whole world with explicit split sizes:
a worker that is not a server simply receives nothing. The counts go first, in their own small
all_to_all, because gloo does not check that the splits of both sides agree; that message also
carries an error flag so that a bad id on one rank fails every rank at once instead of hanging
the others.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from parallax.cluster import WorkerInfo


class SparseIdError(IndexError):
    """A batch holds an id outside the rows of a sparse parameter."""


class RowPartitioning:
    """Where each row of a ``num_rows``-row table lives: owning rank and row inside its shard."""

    def __init__(self, num_rows: int, num_partitions: int, server_ranks: tuple[int, ...]):
        self.num_rows = num_rows
        self.num_partitions = num_partitions
        self.server_ranks = server_ranks
        sizes = [max(0, (num_rows - p + num_partitions - 1) // num_partitions)
                 for p in range(num_partitions)]
        owners, offsets = [], []
        self.shard_rows = [0] * len(server_ranks)
        for p, size in enumerate(sizes):
            server = p % len(server_ranks)
            owners.append(server_ranks[server])
            offsets.append(self.shard_rows[server])
            self.shard_rows[server] += size
        self._owner_of_partition = torch.tensor(owners, dtype=torch.long)
        self._offset_of_partition = torch.tensor(offsets, dtype=torch.long)

    def owner_rank(self, ids: Tensor) -> Tensor:
        return self._owner_of_partition.to(ids.device)[ids % self.num_partitions]

    def local_row(self, ids: Tensor) -> Tensor:
        offsets = self._offset_of_partition.to(ids.device)
        return offsets[ids % self.num_partitions] + ids // self.num_partitions

    def rows_of_server(self, server_index: int) -> Tensor:
        """Global ids held by one server, in the order of its shard."""
        parts = [torch.arange(p, max(p, self.num_rows), self.num_partitions)
                 for p in range(self.num_partitions)
                 if p % len(self.server_ranks) == server_index]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)


@dataclass
class _Route:
    """How the unique ids of one lookup travelled, so that their gradients go back the same way."""

    order: Tensor          # permutation sorting the unique ids by owner rank
    send_counts: list[int]
    recv_counts: list[int]
    recv_local_rows: Tensor  # on a server: the shard rows the received ids address


@dataclass
class _Lookup:
    rows: Tensor   # leaf tensor [unique ids, dim]; its .grad is what gets pushed
    route: _Route


class ShardedTable:
    """One sparse parameter held by the servers; a collective object (every rank calls it)."""

    def __init__(self, name: str, weight: Tensor, *, num_partitions: int, worker: WorkerInfo,
                 group: dist.ProcessGroup, sparse_grad: bool, average: bool):
        if weight.dim() < 2:
            raise ValueError(f"sparse parameter '{name}' must have rows (dim >= 2), "
                             f"got shape {tuple(weight.shape)}")
        self.name = name
        self.num_rows = weight.shape[0]
        self.row_shape = tuple(weight.shape[1:])
        self.dtype = weight.dtype
        self.device = weight.device
        self.worker = worker
        self.group = group
        self.sparse_grad = sparse_grad
        self.average = average
        self.partitioning = RowPartitioning(self.num_rows, num_partitions, worker.server_ranks)
        self.shard: nn.Parameter | None = None
        self._pending: list[_Lookup] = []
        self._sparse_pieces: list[tuple[Tensor, Tensor]] = []
        # Rank 0's initial values are the model's, whatever the other ranks' seeds were.
        initial = weight.detach().clone()
        dist.broadcast(initial, src=0, group=group)
        if worker.is_server:
            mine = self.partitioning.rows_of_server(worker.server_ranks.index(worker.rank))
            self.shard = nn.Parameter(initial[mine.to(initial.device)].clone())

    # ---- forward: pull -------------------------------------------------------------------
    def lookup(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """Pull the rows ``ids`` needs. Returns ``(rows, inverse)`` with ``rows[inverse]`` the
        looked-up values; ``rows`` is a leaf whose gradient `push_gradients` sends back."""
        if ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"sparse parameter '{self.name}' on rank {self.worker.rank}: "
                            f"ids must be an integer tensor, got {ids.dtype}")
        unique, inverse = torch.unique(ids.reshape(-1).long(), return_inverse=True)
        rows, route = self._pull(unique)
        if torch.is_grad_enabled():
            rows.requires_grad_(True)
            self._pending.append(_Lookup(rows, route))
        return rows, inverse.view(ids.shape)

    def read_rows(self, ids: Tensor) -> Tensor:
        """Current values of rows ``ids`` (collective; used for export)."""
        with torch.no_grad():
            rows, inverse = self.lookup(ids)
        return rows[inverse]

    def _pull(self, unique: Tensor) -> tuple[Tensor, _Route]:
        error = None
        if unique.numel() and (unique[0] < 0 or unique[-1] >= self.num_rows):
            error = int(unique[0] if unique[0] < 0 else unique[-1])
        owner = self.partitioning.owner_rank(unique.clamp(0, max(self.num_rows - 1, 0)))
        order = torch.argsort(owner, stable=True)
        send_ids = unique[order].contiguous()
        send_counts = torch.bincount(owner, minlength=self.worker.world_size).tolist()
        recv_counts = self._exchange_counts(send_counts, error)
        recv_ids = torch.empty(sum(recv_counts), dtype=torch.long, device=unique.device)
        dist.all_to_all_single(recv_ids, send_ids, recv_counts, send_counts, group=self.group)
        local = self.partitioning.local_row(recv_ids)
        if self.shard is not None:
            served = self.shard.detach()[local]
        else:
            served = torch.empty((0, *self.row_shape), dtype=self.dtype, device=self.device)
        sorted_rows = torch.empty((unique.numel(), *self.row_shape), dtype=self.dtype,
                                  device=self.device)
        dist.all_to_all_single(sorted_rows, served.contiguous(), send_counts, recv_counts,
                               group=self.group)
        rows = torch.empty_like(sorted_rows)
        rows[order] = sorted_rows
        return rows, _Route(order, send_counts, recv_counts, local)

    def _exchange_counts(self, send_counts: list[int], bad_id: int | None) -> list[int]:
        world = self.worker.world_size
        message = torch.zeros(world, 3, dtype=torch.long, device=self.device)
        message[:, 0] = torch.tensor(send_counts, dtype=torch.long)
        if bad_id is not None:
            message[:, 1] = 1
            message[:, 2] = bad_id
        received = torch.empty_like(message)
        dist.all_to_all_single(received, message, group=self.group)
        failed = received[:, 1].nonzero().flatten().tolist()
        if failed:
            rank = failed[0]
            raise SparseIdError(
                f"parallax: sparse parameter '{self.name}' got id {int(received[rank, 2])} "
                f"on rank {rank} (machine {self.worker.machine_of_rank[rank]}), outside its "
                f"rows [0, {self.num_rows})"
            )
        return received[:, 0].tolist()

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
        for lookup in self._pending:
            grad = lookup.rows.grad
            if grad is None:
                grad = torch.zeros_like(lookup.rows)
            route = lookup.route
            received = torch.empty((sum(route.recv_counts), *self.row_shape), dtype=self.dtype,
                                   device=self.device)
            dist.all_to_all_single(received, grad[route.order].contiguous(), route.recv_counts,
                                   route.send_counts, group=self.group)
            if self.shard is not None:
                if self.average:
                    received.div_(self.worker.world_size)
                self._accumulate(route.recv_local_rows, received)
        self._pending.clear()
        self._finish_sparse_grad()

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
            values = torch.empty((0, *self.row_shape), dtype=self.dtype, device=self.device)
        grad = torch.sparse_coo_tensor(rows.unsqueeze(0), values, self.shard.shape,
                                       check_invariants=False)
        self.shard.grad = grad.coalesce()
        self._sparse_pieces.clear()

    def grad_norm_squared(self) -> Tensor:
        """This server's part of the squared global gradient norm (0 on non-servers)."""
        grad = None if self.shard is None else self.shard.grad
        if grad is None:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        values = grad._values() if grad.is_sparse else grad
        return torch.linalg.vector_norm(values, dtype=torch.float64) ** 2

    def scale_grad(self, factor: Tensor) -> None:
        if self.shard is not None and self.shard.grad is not None:
            self.shard.grad.mul_(factor.to(self.dtype))

    def full_weight(self) -> Tensor:
        """The whole table, gathered from the servers (collective)."""
        ids = torch.arange(self.num_rows, device=self.device)
        return self.read_rows(ids)
