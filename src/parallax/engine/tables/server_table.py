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

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from parallax.cluster import WorkerInfo
from parallax.engine.diagnostics import phases
from parallax.engine.tables import lookup_options, pooled
from parallax.engine.tables.bag_use import BagUse
from parallax.engine.tables.exchange import (
    Hop,
    Traffic,
    all_to_all,
    read_back,
    unique_ids,
    unique_ids_many,
)
from parallax.engine.tables.partitioning import RowPartitioning
from parallax.engine.tables.pool import SERIAL, PartitionPool
from parallax.engine.tables.reservations import Reservations, open_carrying
from parallax.engine.tables.riders import Rider, alight, board
from parallax.engine.tables.verdict import Verdict, bound_of
from parallax.errors import ArgumentError, InternalError, SparseIdError

__all__ = ["RowPartitioning", "ShardedTable", "SparseIdError", "can_push_early",
           "pending_pulls", "prefetch", "pull", "push_gradients", "rows_pulled_ahead",
           "start_push"]


@dataclass
class _Lookup:
    """One table's part of a `_Pull`."""

    ids: Tensor                 # this worker's unique ids
    rows: Tensor                # leaf [unique ids, *row]; its .grad is what gets pushed
    # permutation sorting the (merged) ids by owner rank; None: already sorted (one owner)
    order: Tensor | None
    recv_local_rows: Tensor     # on a server: the shard rows the received ids address
    # those rows are sorted and distinct (one sender's unique ids, one partition here)
    local_sorted: bool = False
    merged_inverse: Tensor | None = None  # at a leader: received piece -> merged row
    merged_count: int = 0
    counts: Tensor | None = None  # scale_grad_by_freq: how often the batch looked up each id


@dataclass
class _Pull:
    """Rows of several tables pulled in one exchange; their gradients go back the same way
    (in one exchange, or, pushed early, in one per group of tables: `start_push`)."""

    lookups: dict[str, _Lookup]
    direct: Hop                   # worker -> owners (leader -> owners when aggregating)
    to_leader: Hop | None = None  # worker -> its machine's leader (local aggregation)
    # pushed early: the exchanges issued (each returns what its owners received) and their
    # tables; `push_gradients` waits for them
    in_flight: list[Callable[[], dict[str, Tensor]]] = field(default_factory=list)
    launched: list[str] = field(default_factory=list)


@dataclass
class _Prefetched:
    """A table's rows pulled ahead of the forward, for all of the step's lookups at once."""

    ids: Tensor   # sorted unique ids
    rows: Tensor  # the pull's leaf rows
    # per lookup read ahead: its ids tensor, that tensor's version then (None: an inference
    # tensor, which keeps none), and the index of each of its ids among ``ids`` (the pull's
    # inverse)
    lookups: list[tuple[Tensor, int | None, Tensor]] = field(default_factory=list)

    def inverse_of(self, ids: Tensor) -> Tensor | None:
        """The index of each of ``ids`` among the pulled rows when ``ids`` is the very tensor
        a lookup was read ahead from, or a view of the same memory laid out alike (the
        forward's own ``x[:, 0]`` beside the look-ahead's), unchanged since (no in-place
        write: views share their base's version); None otherwise (the lookup then finds its
        ids among the pulled ones)."""
        for known, version, inverse in self.lookups:
            if (version is not None and _same_memory(known, ids)
                    and version == _version_of(ids)):
                return inverse.view(ids.shape)
        return None


def _same_memory(known: Tensor, ids: Tensor) -> bool:
    """Whether ``ids`` reads the very elements ``known`` reads, as ``known`` reads them
    (``known`` is kept alive, so its storage cannot be another tensor's since)."""
    return known is ids or (
        known.numel() > 0 and ids.layout == known.layout == torch.strided
        and known.dtype == ids.dtype and known.device == ids.device
        and known.shape == ids.shape and known.stride() == ids.stride()
        and known.storage_offset() == ids.storage_offset()
        and known.untyped_storage().data_ptr() == ids.untyped_storage().data_ptr())


def _version_of(ids: Tensor) -> int | None:
    """``ids``' version counter (bumped by every in-place write), None for an inference
    tensor (made under ``torch.inference_mode``), which has none: such ids are searched."""
    return None if ids.is_inference() else ids._version


#: the most bytes of a table (or of its optimizer state) rank 0 sends per round of
#: `ShardedTable.scatter_from_rank0`: its transient copy beside the program's table. Small:
#: glibc keeps freed rounds in its heap (its mmap threshold rises to a freed block's size, up
#: to 32 MiB), so a round's size stays resident (16 MiB rather than 64 lowered rank 0's peak:
#: the memory records of the recommender, memory-recsys-2x2-1gbit)
SCATTER_ROUND_BYTES = 16 * 2**20


def _round_bounds(count: int, k: int, rounds: int) -> tuple[int, int]:
    """Round ``k`` of ``rounds``' slice of ``count`` rows (near-equal slices)."""
    return count * k // rounds, count * (k + 1) // rounds


class ShardedTable:
    """One parameter held by the servers; a collective object (every rank calls it).
    Implements `parallax.engine.tables.table.Table`."""

    sync = "ps"
    on_servers = True
    exchanges = True
    replica = None  # no worker holds the whole parameter
    #: bags pooled on the owner (`parallax.engine.tables.pooled`): set where the layout is
    #: built (`Config.pooled_tables`) or by the planner after the warm-up
    pools = False
    #: pooled where its rows live, every server its share (`Config.pooled_by_rows`)
    pools_by_rows = False
    #: held as this many column slices, slice k as partition k (`Config.pooled_by_columns`:
    #: the table is then the view of the program's ``R x d`` one as ``R*K x d/K`` rows)
    column_slices = 1
    measuring = True  # `Table.measuring`

    @property
    def held(self) -> ShardedTable:
        return self

    def __init__(self, name: str, weight: Tensor, *, num_partitions: int, worker: WorkerInfo,
                 group: dist.ProcessGroup, traffic: Traffic, sparse_grad: bool, average: bool,
                 local_aggregation: bool = False, first_server: int = 0,
                 batch_dependent: lookup_options.BatchDependent | None = None,
                 initial_rows: Callable[[Tensor], Tensor] | None = None):
        if weight.dim() < 1:
            raise ArgumentError(f"parameter '{name}' must have rows (dim >= 1), got a scalar")
        lookup_options.check_batch_dependent(name, batch_dependent, sparse_grad)
        self.name = name
        # max_norm: owners renormalise the rows of every pull (all workers' ids) before
        # serving them; scale_grad_by_freq: workers push their id counts with the gradient
        # rows, owners divide each aggregated row by its count over the global batch.
        self.batch_dependent = batch_dependent
        self._lookups = 0  # with gradients, this step (scale_grad_by_freq allows one)
        self._received_counts: list[tuple[Tensor, Tensor]] = []
        self.num_rows = weight.shape[0]
        self.row_shape = tuple(weight.shape[1:])
        self.dtype = weight.dtype
        # (a parallax.meta_init parameter is on meta: the table lives on the worker's device)
        self.device = worker.device if weight.device.type == "meta" else weight.device
        self.worker = worker
        self.group = group
        self.traffic = traffic
        self.sparse_grad = sparse_grad
        self.average = average
        # (with one worker per machine every worker is its own leader: nothing to merge, and
        # the leader hop would only add collectives)
        self.local_aggregation = (local_aggregation
                                  and worker.world_size > len(worker.server_ranks))
        self.partitioning = RowPartitioning(self.num_rows, num_partitions, worker.server_ranks,
                                            first_server)
        # room for this table's ids in a pull's one message (reset when the rows move)
        self.reservations = Reservations(worker.world_size)
        self.shard: nn.Parameter | None = None
        # The shard's partitions as parameters viewing its storage: the unit of the servers'
        # parallel aggregation and update (the shard itself when it holds one partition).
        self.parts: list[nn.Parameter] = []
        self.blocks: list[tuple[int, int]] = []
        self.pool: PartitionPool = SERIAL
        self._init_step_state()
        # Rank 0's initial values are the model's, whatever the other ranks' seeds were; each
        # server receives its own rows only (no process but rank 0 ever holds the whole).
        # ``initial_rows`` (global ids -> their values; a parallax.meta_init recipe): each
        # server makes its own rows, and no process ever holds the whole.
        if initial_rows is None:
            rows = self.scatter_from_rank0(weight.detach())
        elif worker.is_server:
            rows = initial_rows(self.own_ids()).to(self.device)
        if worker.is_server:
            self.set_shard(nn.Parameter(rows))

    def _init_step_state(self) -> None:
        """What a step's pulls, pushes and updates keep between their calls."""
        self.rows_used: list[int] = []          # per training step, this worker's rows
        self.machine_rows_used: list[int] = []  # per step at a leader: its machine's rows
        self.bag_use = BagUse()
        self._pending: list[_Pull] = []  # this step's pulls that hold rows of this table
        # Whether the single-device parameter would have a .grad now: a backward reached
        # this table's rows on this worker since the last clear to None (`has_gradient`), on
        # any worker (`gradient_anywhere`, agreed by the runner before the update). Without
        # one the servers' optimizer skips the table, as torch skips a .grad of None (Adam
        # would otherwise move every row with a zero gradient).
        self.has_gradient = False
        self.gradient_anywhere = True
        self.prefetched: _Prefetched | None = None
        self.pooled_calls: list[pooled.PooledExchange] = []  # this step's, until pushed
        self.pooled_ahead: list[tuple[pooled.BagCall, Tensor]] = []  # this forward's
        # the rooms reserved for pooled calls' ids, per exchange key (`pooled.pool_many`)
        self.pooled_reservations: dict[str, Reservations] = {}
        # (shard rows, gradient rows) received this step, summed by `_finish_aggregation`
        self._received: list[tuple[Tensor, Tensor]] = []
        # shard rows that received gradient since the last zero_grad (`touched_rows_by_part`)
        self._touched: list[Tensor] = []
        self._touched_sorted = False  # `_touched` is one entry, sorted and distinct
        self._touched_unique: Tensor | None = None  # `touched_rows`, until more arrive
        # the partitions' first rows as a tensor, and what they were made for
        self._block_starts: tuple[tuple[object, ...], Tensor] | None = None
        # Set by the servers' optimizer when its class (torch's own) never writes gradients:
        # a dense gradient is then zero outside the touched rows, unless a non-finite factor
        # scaled it whole (0 x inf), which `_grad_scaled_everywhere` records.
        self.grad_zero_elsewhere = False
        self._grad_scaled_everywhere = False
        # Set by the servers' optimizer where row updates are deferred (SGD with momentum or
        # weight decay): called with shard rows (None: all) before they are read or written.
        self.before_read: Callable[[Tensor | None], None] | None = None

    def scatter_from_rank0(self, weight: Tensor) -> Tensor:
        """This rank's shard rows of rank 0's ``weight`` (the parameter's values, or per-row
        optimizer state shaped like it; collective; empty off the servers). Only rank 0 reads
        ``weight``'s values. Not counted as training traffic.

        In rounds of at most `SCATTER_ROUND_BYTES` (every rank knows every count from the
        partitioning, so no count message): rank 0 never holds a second copy of a whole table
        beside the program's, and each server receives straight into its shard."""
        worker, partitioning = self.worker, self.partitioning
        mine = (partitioning.shard_rows[worker.server_ranks.index(worker.rank)]
                if worker.is_server else 0)
        # (a table pooled by columns is given shaped as the program's: its rows' view)
        weight = weight.reshape(self.num_rows, *self.row_shape)
        # (off rank 0 ``weight`` may be the program's released copy, on meta: only its dtype)
        device = self.device if weight.device.type == "meta" else weight.device
        out = torch.empty((mine, *self.row_shape), dtype=weight.dtype, device=device)
        # (counted at 8 bytes an element whatever the dtype: every rank counts alike)
        rounds = max(1, math.ceil(self.num_rows * 8 * math.prod(self.row_shape)
                                  / SCATTER_ROUND_BYTES))
        held = ({rank: partitioning.rows_of_server(index).to(weight.device)
                 for index, rank in enumerate(worker.server_ranks)}
                if worker.rank == 0 else {})
        for k in range(rounds):
            send, receive = [0] * worker.world_size, [0] * worker.world_size
            ids = {rank: held[rank][slice(*_round_bounds(held[rank].numel(), k, rounds))]
                   for rank in sorted(held)}
            for rank, rows in ids.items():
                send[rank] = rows.numel()
            payload = torch.empty((sum(send), *self.row_shape), dtype=weight.dtype,
                                  device=device)
            # gathered straight into the round's one message, in rank order
            for rows, room in zip(ids.values(), payload.split([send[rank] for rank in ids]),
                                  strict=True):
                torch.index_select(weight, 0, rows, out=room)
            start, stop = _round_bounds(mine, k, rounds)
            receive[0] = stop - start
            all_to_all(out[start:stop], payload, receive, send, group=self.group)
        return out

    def assign(self, weight: Tensor) -> None:
        """Set the whole parameter's values (every rank passes the same ``weight``): each
        server copies its own rows."""
        if self.shard is not None:
            self.settle()
            with torch.no_grad():
                self.shard.copy_(self.own_rows(weight.detach()))

    def settle(self) -> None:
        """Bring every row of this server's shard (and its optimizer state) up to date: apply
        the update steps the servers' optimizer deferred (before a whole read or write)."""
        if self.shard is not None and self.before_read is not None:
            self.before_read(None)

    def own_ids(self) -> Tensor:
        """Global ids of this server's rows, in its shard's order (call on a server)."""
        return self.partitioning.rows_of_server(self.worker.server_ranks.index(self.worker.rank))

    def own_rows(self, whole: Tensor) -> Tensor:
        """This server's rows of ``whole``, a tensor shaped like the parameter (its values or
        per-row optimizer state), in shard order, on the shard's device and dtype."""
        full = whole.reshape(self.num_rows, *self.row_shape)
        return full[self.own_ids().to(full.device)].to(self.device, self.dtype)

    def set_shard(self, shard: nn.Parameter) -> None:
        """Hold ``shard`` (this server's rows under the current partitioning)."""
        self.shard = shard
        self._touched, self._touched_unique = [], None
        self.blocks = self.partitioning.shard_blocks(
            self.worker.server_ranks.index(self.worker.rank)) or [(0, 0)]
        if len(self.blocks) == 1:
            self.parts = [shard]
        else:
            self.parts = [nn.Parameter(shard.data[start:stop], requires_grad=shard.requires_grad)
                          for start, stop in self.blocks]

    @property
    def _leader(self) -> int:
        return self.worker.server_ranks[self.worker.machine]

    def _rows(self, count: int) -> Tensor:
        return torch.empty((count, *self.row_shape), dtype=self.dtype, device=self.device)

    # ---- forward: pull ------------------------------------------------------------------
    def lookup(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """Pull the rows ``ids`` needs. Returns ``(rows, inverse)`` with ``rows[inverse]`` the
        looked-up values; the gradient of ``rows`` is what `push_gradients` sends back. Served
        from the rows `pull` prefetched for this step when there are any."""
        if self.scales_by_freq and torch.is_grad_enabled():
            self._lookups += 1
            lookup_options.check_one_lookup(self.name, self.worker.rank, self._lookups)
        if self.prefetched is None:
            return pull([self], [ids])[0]
        held = self.prefetched
        # the ids a lookup was read from ahead: the pull's leaf rows and inverse serve it as
        # they serve a lookup pulled on its own (no second unique, search or gather)
        ahead = held.inverse_of(ids)
        if ahead is not None:
            return held.rows, ahead
        unique, inverse, bad_id = unique_ids(ids, self.num_rows, self.name, self.worker.rank)
        return rows_pulled_ahead(held.ids, held.rows, unique, self.name, self.worker.rank,
                                 bad_id=bad_id), inverse

    def pool_bags(self, ids: Tensor, offsets: Tensor | None, per_sample_weights: Tensor | None, *,
                  mode: str, padding_idx: int | None, include_last_offset: bool) -> Tensor:
        """``F.embedding_bag`` of this table computed on its owner: this rank's pooled rows
        (collective; a table with ``pools`` only, `parallax.engine.tables.pooled`)."""
        call = pooled.bag_call(self, ids, offsets, per_sample_weights, mode=mode,
                               padding_idx=padding_idx, include_last_offset=include_last_offset)
        if self.pooled_ahead:  # pooled before the forward (`pooled.pool_ahead`)
            return pooled.serve_ahead(call)
        return pooled.pool_many([call])[0]

    def read_rows(self, ids: Tensor, source: Tensor | None = None) -> Tensor:
        """Current values of rows ``ids`` (collective; for export and migration), from the
        shards or from ``source``, a tensor each server holds shaped like its shard."""
        with torch.no_grad():
            unique, inverse = torch.unique(ids.reshape(-1), return_inverse=True)
            rows = _pull_direct([self], [unique], [None], source)[0][self.name]
        if unique.numel() == ids.numel() and torch.equal(unique, ids.reshape(-1)):
            return rows.view(*ids.shape, *self.row_shape)  # ids in order (a move's): no copy
        return rows[inverse].view(*ids.shape, *self.row_shape)

    @property
    def scales_by_freq(self) -> bool:
        return lookup_options.scales_by_freq(self.batch_dependent)

    # ---- backward: push ------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the aggregated gradient and the gradients the pulled rows hold, as
        ``zero_grad`` clears leaves on one device. Pulls not yet pushed stay: a backward may
        still come (a forward, then ``zero_grad``, then the backward is a valid program).
        ``set_to_none``: the single-device gradient is None until the next backward (else
        zeros, and the optimizer still steps the table)."""
        if set_to_none:
            self.has_gradient = False
        for record in self._pending:
            record.lookups[self.name].rows.grad = None
        for exchange in self.pooled_calls:
            for call, out in zip(exchange.calls, exchange.outs, strict=True):
                if call.table is self:
                    out.grad = None
        self.prefetched = None
        self._received.clear()
        self._received_counts.clear()
        self._lookups = 0
        if self.shard is not None and self.sparse_grad:
            for part in self.parts:
                part.grad = None
        elif self.shard is not None:
            self._zero_dense_grad()
        self._touched.clear()
        self._touched_unique = None

    def _zero_dense_grad(self) -> None:
        """A zero dense gradient for the shard, its partitions' gradients viewing it. Where
        only the touched rows can be non-zero (`grad_zero_elsewhere`), only they are zeroed:
        a pass over the whole shard per step saved."""
        shard = self.server_shard()
        if shard.grad is None:
            shard.grad = torch.zeros_like(shard)
        elif self.grad_zero_elsewhere and not self._grad_scaled_everywhere:
            shard.grad.index_fill_(0, self.touched_rows(), 0)
        else:
            shard.grad.zero_()
        self._grad_scaled_everywhere = False
        if len(self.parts) > 1:
            grad = _grad_of(shard)
            for part, (start, stop) in zip(self.parts, self.blocks, strict=True):
                part.grad = grad[start:stop]

    @staticmethod
    def push_together(tables: Sequence[ShardedTable], verdict: Verdict | None = None,
                      riders: Sequence[Rider] = ()) -> None:
        """All server-held tables' gradient rows in one exchange (`push_gradients`), the
        step's ``verdict`` and ``riders`` in the first message."""
        push_gradients(tables, verdict, riders)

    def push_gradients(self) -> None:
        """`push_gradients` of this table alone."""
        push_gradients([self])

    def _record_usage(self) -> None:
        if not self._pending:
            return
        lookups = [pull.lookups[self.name] for pull in self._pending]
        self.has_gradient = self.has_gradient or any(
            lookup.rows.grad is not None for lookup in lookups)
        if not self.measuring:
            return
        ids = torch.cat([lookup.ids for lookup in lookups])
        self.rows_used.append(int(torch.unique(ids).numel()))
        if self.local_aggregation and self.worker.rank == self._leader:
            self.machine_rows_used.append(sum(lookup.merged_count for lookup in lookups))

    @property
    def sums_as_rows_arrive(self) -> bool:
        """Whether gradient rows go straight into the shard's dense gradient as they arrive
        (one partition, dense gradients), so that rows repeated in one arrival cost nothing
        more than distinct ones (`_accumulate`)."""
        return not self.sparse_grad and len(self.parts) == 1

    def _accumulate(self, local_rows: Tensor, grad_rows: Tensor,
                    touched: Tensor | None = None, sorted_distinct: bool = False) -> None:
        """Add ``grad_rows`` at shard rows ``local_rows`` (repeats allowed); ``touched``: those
        rows, distinct, where the caller has them; ``sorted_distinct``: ``local_rows`` are
        sorted and distinct already."""
        self._touched_sorted = sorted_distinct and not self._touched
        self._touched.append(local_rows if touched is None else touched)
        self._touched_unique = None
        if self.sparse_grad or len(self.parts) > 1:
            self._received.append((local_rows, grad_rows))
        else:
            shard = self.server_shard()
            if shard.grad is None:  # no zero_grad before the first backward
                self._zero_dense_grad()
            _grad_of(shard).index_add_(0, local_rows, grad_rows)

    def _finish_aggregation(self) -> None:
        """Sum the received gradient rows per partition, the partitions in parallel: into the
        shard's gradient (dense gradients), or into each partition's coalesced sparse gradient.
        With one partition, dense rows were summed as they arrived."""
        if self.shard is None or not (self.sparse_grad or len(self.parts) > 1):
            return
        if not self.sparse_grad and self.shard.grad is None:  # no zero_grad before
            self._zero_dense_grad()
        if self._received:
            rows = torch.cat([rows for rows, _ in self._received])
            values = torch.cat([values for _, values in self._received])
        else:
            rows = torch.empty(0, dtype=torch.long, device=self.device)
            values = self._rows(0)
        self._received.clear()
        if len(self.parts) > 1:  # group the rows by partition: one slice each
            rows, order = torch.sort(rows, stable=True)
            values = values.index_select(0, order)  # (rows: faster than values[order])
            starts = torch.tensor([start for start, _ in self.blocks]
                                  + [self.server_shard().shape[0]],
                                  dtype=rows.dtype, device=rows.device)
            bounds = torch.searchsorted(rows, starts).tolist()
        else:
            bounds = [0, rows.numel()]
        tasks = [self._aggregate_task(part, start, rows[bounds[i]:bounds[i + 1]],
                                      values[bounds[i]:bounds[i + 1]])
                 for i, (part, (start, _)) in enumerate(zip(self.parts, self.blocks, strict=True))]
        self.pool.run(tasks)

    def _aggregate_task(self, part: nn.Parameter, start: int, rows: Tensor,
                        values: Tensor) -> Callable[[], None]:
        def aggregate() -> None:
            if not self.sparse_grad:
                _grad_of(part).index_add_(0, rows - start, values)
                return
            grad = torch.sparse_coo_tensor((rows - start).unsqueeze(0), values, part.shape,
                                           check_invariants=False)
            # accumulated onto a gradient no zero_grad cleared, as autograd does
            part.grad = (grad if part.grad is None else part.grad + grad).coalesce()
        return aggregate

    def server_shard(self) -> nn.Parameter:
        """The shard, on a server of this table (what only servers call asks for it)."""
        if self.shard is None:
            raise InternalError(f"rank {self.worker.rank} holds no shard of '{self.name}'; "
                                f"please report it")
        return self.shard

    @property
    def _one_partition(self) -> bool:
        """Whether this server's shard is one partition (from the shard's first row)."""
        return len(self.blocks) == 1 and self.blocks[0][0] == 0

    def shard_rows_of(self, ids: Tensor) -> Tensor:
        """The rows of this server's shard that hold ``ids`` (ids this rank owns)."""
        if self._one_partition:
            # its local row is the id's quotient (ids itself with one partition in all),
            # without the partition tables' lookups
            partitions = self.partitioning.num_partitions
            return ids if partitions == 1 else ids // partitions
        return self.partitioning.local_row(ids)

    def touched_rows(self) -> Tensor:
        """The (sorted, distinct) shard rows that received gradient since the last zero_grad:
        the only rows whose aggregated gradient can be non-zero."""
        if self._touched_unique is None and self._touched_sorted and len(self._touched) == 1:
            self._touched_unique = self._touched[0]  # (no unique: on a GPU it is a wait)
        if self._touched_unique is None:
            self._touched_unique = (
                torch.unique(torch.cat(self._touched)) if self._touched
                else torch.empty(0, dtype=torch.long, device=self.device))
        return self._touched_unique

    def touched_rows_by_part(self) -> list[Tensor]:
        """Per partition, `touched_rows` in the partition's own row numbers."""
        rows = self.touched_rows()
        if self._one_partition:  # the shard's rows are the partition's
            return [rows]
        key = (*self.blocks, self.server_shard().shape[0], rows.dtype, rows.device)
        if self._block_starts is None or self._block_starts[0] != key:
            # made once per partitioning: on a GPU each would be a copy and a wait
            self._block_starts = (key, torch.tensor(
                [start for start, _ in self.blocks] + [self.server_shard().shape[0]],
                dtype=rows.dtype, device=rows.device))
        bounds = torch.searchsorted(rows, self._block_starts[1]).tolist()
        return [rows[bounds[i]:bounds[i + 1]] - start
                for i, (start, _) in enumerate(self.blocks)]

    def _divide_by_counts(self) -> None:
        """scale_grad_by_freq: each aggregated row over its count in the global batch (rows
        nobody looked up have a zero gradient and stay so)."""
        received, self._received_counts = self._received_counts, []
        if self.shard is None or not received:
            return
        total = torch.zeros(self.shard.shape[0], dtype=self.dtype, device=self.device)
        total.index_add_(0, torch.cat([rows for rows, _ in received]),
                         torch.cat([counts for _, counts in received]))
        lookup_options.divide_by_counts(_grad_of(self.shard), total)

    def _gradients(self) -> list[Tensor]:
        """This server's aggregated gradient, as whole tensors (the shard's, or its
        partitions' sparse ones)."""
        if self.shard is None:
            return []
        if not self.sparse_grad:
            return [] if self.shard.grad is None else [self.shard.grad]
        return [part.grad for part in self.parts if part.grad is not None]

    def grad_norm_squared(self) -> Tensor:
        """This server's part of the squared global gradient norm (0 on non-servers): computed
        where the aggregated gradient lives, so only a scalar travels. A dense gradient is
        read at its touched rows only (the others are zero), not cast whole to float64."""
        squared = torch.zeros((), dtype=torch.float64, device=self.device)
        for grad in self._gradients():
            rows = self._rows_to_read(grad)
            values = grad._values() if grad.is_sparse else grad if rows is None else grad[rows]
            squared += torch.linalg.vector_norm(values, dtype=torch.float64) ** 2
        return squared

    def scale_grad(self, factor: Tensor) -> None:
        """Multiply the aggregated gradient by ``factor`` (clipping, a loss scaler's unscale):
        a dense one at its touched rows, the others being zero, unless ``factor`` is NaN or
        infinite (0 x inf is NaN on one device too)."""
        factor = factor.to(self.dtype)
        finite = bool(torch.isfinite(factor))
        for grad in self._gradients():
            rows = self._rows_to_read(grad)
            if rows is None or not finite:
                grad.mul_(factor)
                self._grad_scaled_everywhere |= not finite and not grad.is_sparse
            else:
                grad[rows] = grad[rows] * factor

    def clamp_grad(self, value: float) -> None:
        """Clamp the aggregated gradient to ``[-value, value]``: a dense one at its touched
        rows (the others are zero), a sparse one's values (coalesced: one value per
        element)."""
        for grad in self._gradients():
            rows = self._rows_to_read(grad)
            if grad.is_sparse:
                grad._values().clamp_(-value, value)
            elif rows is None:
                grad.clamp_(-value, value)
            else:
                grad[rows] = grad[rows].clamp(-value, value)

    def _rows_to_read(self, grad: Tensor) -> Tensor | None:
        """The rows of a dense aggregated ``grad`` that can be non-zero, when they are fewer
        than all; None: read it whole (sparse, or every row touched)."""
        if grad.is_sparse:
            return None
        rows = self.touched_rows()
        return None if rows.numel() == grad.shape[0] else rows

    def full_weight(self, source: Tensor | None = None) -> Tensor:
        """The whole table (or a shard-shaped ``source``), gathered from the servers
        (collective)."""
        return self.read_rows(torch.arange(self.num_rows, device=self.device), source)


# ---- several tables at once ------------------------------------------------------------------
def rows_pulled_ahead(held: Tensor, rows: Tensor, unique: Tensor, name: str, rank: int, *,
                      bad_id: int | None = None) -> Tensor:
    """The rows of the sorted ``unique`` ids among a step's prefetched ``held`` ids and their
    ``rows`` (every lookup's ids were pulled ahead, and the pull refused out-of-range ones:
    anything else is a bug of ours)."""
    position = torch.searchsorted(held, unique)
    if bad_id is not None or unique.numel() and (held.numel() == 0 or not torch.equal(
            held[position.clamp_max(held.numel() - 1)], unique)):
        raise InternalError(
            f"parallax internal error: rank {rank} looked up ids of '{name}' that were not "
            f"pulled ahead for this step; please report it")
    return rows[position]


def pull(tables: Sequence[ShardedTable], ids: Sequence[Tensor]) -> list[tuple[Tensor, Tensor]]:
    """Rows of ``ids[i]`` from ``tables[i]`` (distinct tables of one runner), all in one
    exchange; ``(rows, inverse)`` per table as `ShardedTable.lookup` returns them."""
    return [(rows, inverse) for rows, inverse, _ in _timed_pull(tables, ids)]


def _timed_pull(tables: Sequence[ShardedTable], ids: Sequence[Tensor],
                ) -> list[tuple[Tensor, Tensor, Tensor]]:
    with phases.phase("pull"):
        return _pull(tables, ids)


def _pull(tables: Sequence[ShardedTable], ids: Sequence[Tensor],
          ) -> list[tuple[Tensor, Tensor, Tensor]]:
    """`pull`'s ``(rows, inverse)`` per table, and the sorted unique ids the rows are of."""
    first = tables[0]
    requests = unique_ids_many(ids, [t.num_rows for t in tables], [t.name for t in tables],
                               first.worker.rank)
    uniques = {t.name: unique for t, (unique, _, _) in zip(tables, requests, strict=True)}
    bad_ids = {t.name: bad for t, (_, _, bad) in zip(tables, requests, strict=True)}
    to_leader = None
    if first.local_aggregation:
        counts = {}
        for table in tables:
            counts[table.name] = [0] * first.worker.world_size
            counts[table.name][table._leader] = uniques[table.name].numel()
        to_leader = _open(tables, counts, bad_ids)
        pieces = to_leader.forward_many(uniques)  # at a leader: every local worker's ids
        merged = {name: torch.unique(piece, return_inverse=True)
                  for name, piece in pieces.items()}
        merged_rows, direct, lookups = _pull_direct(tables, [m for m, _ in merged.values()],
                                                    [None] * len(tables), lookup=True)
        rows = to_leader.backward_many({name: merged_rows[name].index_select(0, inverse)
                                        for name, (_, inverse) in merged.items()})
        for name, (ids_merged, inverse) in merged.items():
            lookups[name].merged_inverse = inverse
            lookups[name].merged_count = ids_merged.numel()
    else:
        rows, direct, lookups = _pull_direct(tables, list(uniques.values()),
                                             list(bad_ids.values()), lookup=True)
    for name, lookup in lookups.items():
        lookup.ids, lookup.rows = uniques[name], rows[name]
    for table, (unique, inverse, _) in zip(tables, requests, strict=True):
        if table.scales_by_freq:
            lookups[table.name].counts = torch.bincount(inverse.reshape(-1),
                                                        minlength=unique.numel())
    if torch.is_grad_enabled():
        record = _Pull(lookups, direct, to_leader)
        for table in tables:
            lookups[table.name].rows.requires_grad_(True)
            table._pending.append(record)
    return [(rows[t.name], inverse, unique)
            for t, (unique, inverse, _) in zip(tables, requests, strict=True)]


def prefetch(tables: Sequence[ShardedTable], ids: Sequence[Sequence[Tensor]]) -> None:
    """Pull, in one exchange, the rows of all lookups a forward is about to make: ``ids[i]``
    lists the ids of every lookup of ``tables[i]``; each lookup is then served locally."""
    # int64 whatever the lookups' dtypes (nn.Embedding takes int32 ids too)
    # (one lookup's ids as they are: the pull only reads them)
    unions = [(table_ids[0].reshape(-1).long() if len(table_ids) == 1 else
               torch.cat([i.reshape(-1).long() for i in table_ids])) if table_ids
              else torch.empty(0, dtype=torch.long) for table_ids in ids]
    pulled = _timed_pull(tables, unions)
    for table, table_ids, (rows, inverse, unique) in zip(tables, ids, pulled, strict=True):
        pieces = inverse.split_with_sizes([i.numel() for i in table_ids])  # each lookup's, in order
        table.prefetched = _Prefetched(unique, rows, [
            (i, _version_of(i), piece) for i, piece in zip(table_ids, pieces, strict=True)])


def _open(tables: Sequence[ShardedTable], counts: dict[str, list[int]],
          bad_ids: dict[str, int | None]) -> Hop:
    first = tables[0]
    return Hop.open_many(counts, group=first.group, traffic=first.traffic,
                         num_rows={t.name: t.num_rows for t in tables}, bad_ids=bad_ids,
                         device=first.device)


def _pull_direct(tables: Sequence[ShardedTable], uniques: Sequence[Tensor],
                 bad_ids: Sequence[int | None], source: Tensor | None = None,
                 lookup: bool = False) -> tuple[dict[str, Tensor], Hop, dict[str, _Lookup]]:
    """Rows ``uniques[i]`` of ``tables[i]`` from their owners' shards (or from ``source``, a
    tensor shaped like the shard, e.g. an optimizer state; one table only). A ``lookup``'s
    pull (training or evaluation, not an export) sends its ids with the count message
    (`open_carrying`), and owners of a ``max_norm`` table first renormalise the requested
    rows in place, as ``F.embedding`` does on one device: the requests of all workers
    together are the global batch's ids, and renormalising is idempotent, so the result is
    exact."""
    world = tables[0].worker.world_size
    orders: dict[str, Tensor | None] = {}
    counts: dict[str, list[int]] = {}
    by_owner: dict[str, Tensor] = {}
    for table, unique, bad_id in zip(tables, uniques, bad_ids, strict=True):
        single = table.partitioning.single_owner
        if single is not None:  # one owner: its count is known here, the ids stay in order
            orders[table.name] = None
            counts[table.name] = [unique.numel() if r == single else 0 for r in range(world)]
            continue
        # (a bad id is refused on every rank once the count message is read: until then it
        # only needs an owner)
        owner = table.partitioning.owner_rank(
            unique if bad_id is None else unique.clamp(0, max(table.num_rows - 1, 0)))
        orders[table.name] = torch.argsort(owner, stable=True)
        by_owner[table.name] = torch.bincount(owner, minlength=world)
    counts.update(zip(by_owner, read_back(list(by_owner.values())), strict=True))
    counts = {t.name: counts[t.name] for t in tables}  # the tables' order: the message's
    sorted_ids = {t.name: _by_owner(u, orders[t.name])
                  for t, u in zip(tables, uniques, strict=True)}
    bad = dict(zip(counts, bad_ids, strict=True))
    if lookup:
        first = tables[0]
        hop, recv_ids = open_carrying(
            sorted_ids, counts, reservations={t.name: t.reservations for t in tables},
            group=first.group, traffic=first.traffic,
            num_rows={t.name: t.num_rows for t in tables}, bad_ids=bad)
    else:
        hop = _open(tables, counts, bad)
        recv_ids = hop.forward_many(sorted_ids)
    served, lookups = {}, {}
    for table in tables:
        local = table.shard_rows_of(recv_ids[table.name])
        if table.shard is not None and table.before_read is not None:
            table.before_read(local)  # deferred steps first (values and optimizer state)
        held = source if source is not None else table.shard
        options = table.batch_dependent
        if lookup and held is not None and options is not None and options.max_norm is not None:
            with torch.no_grad():
                torch.embedding_renorm_(held.detach(), local, options.max_norm,
                                        options.norm_type)
        served[table.name] = (held.detach().index_select(0, local) if held is not None
                              else table._rows(0))
        senders = sum(1 for count in hop.recv_counts[table.name] if count)
        lookups[table.name] = _Lookup(recv_ids[table.name], table._rows(0),
                                      orders[table.name], local,
                                      local_sorted=senders <= 1 and table._one_partition)
    back = hop.backward_many(served)
    rows = {}
    for table, unique in zip(tables, uniques, strict=True):
        order = orders[table.name]
        if order is None:  # (arrived in the ids' order)
            if back[table.name].dtype != table.dtype:
                raise InternalError(f"'{table.name}': rows of {back[table.name].dtype} pulled "
                                    f"for a table of {table.dtype}; please report it")
            rows[table.name] = back[table.name]
            continue
        # (back in the ids' order: one index_copy_, not indexing's Python machinery)
        rows[table.name] = table._rows(unique.numel()).index_copy_(0, order, back[table.name])
    return rows, hop, lookups


def _by_owner(values: Tensor, order: Tensor | None) -> Tensor:
    """``values`` (one per unique id) sorted by owner rank, as a pull's ``order`` says (None:
    already)."""
    return values if order is None else values.index_select(0, order)


def push_gradients(tables: Sequence[ShardedTable], verdict: Verdict | None = None,
                   riders: Sequence[Rider] = ()) -> None:
    """Send the gradient rows of every pull of this step to their servers (collective, in pull
    order, one exchange per pull for all its tables, unless `start_push` sent some already);
    servers sum the rows of all workers and, by default, divide by the worker count.
    ``tables`` must hold every table of those pulls. The step's ``verdict``
    (`parallax.engine.tables.verdict`, prepared here) and the other ``riders`` travel in the
    first message sent here (`parallax.engine.tables.riders`)."""
    by_name = {table.name: table for table in tables}
    for table in tables:
        table._record_usage()
    exchanges = pooled.pending_exchanges(tables)
    records = pending_pulls(tables)
    if verdict is not None and tables:
        _prepare_verdict(verdict, tables, records, exchanges)
    aboard = [*([verdict] if verdict is not None else []), *riders]
    pooled.push_pooled(exchanges, aboard)
    for record in records:
        rest = [name for name in record.lookups if name not in record.launched]
        if record.in_flight:
            if rest:  # the part `EarlyPush` left for here
                start_push(record, rest, aboard)
            for finish in record.in_flight:
                _deliver(record, alight(aboard, finish()), by_name)
            continue
        grads = _gradients_to_push(record, list(record.lookups))
        if record.to_leader is not None:
            hop, payloads = board(aboard, record.to_leader, grads)
            pieces = alight(aboard, hop.forward_many(payloads))
            for name, lookup in record.lookups.items():
                merged = pieces[name].new_zeros((lookup.merged_count, *pieces[name].shape[1:]))
                if lookup.merged_inverse is None:
                    raise InternalError(f"'{name}': a leader's push without its pull's merge")
                grads[name] = merged.index_add_(0, lookup.merged_inverse, pieces[name])
        hop, payloads = board(aboard, record.direct, {
            name: _by_owner(grads[name], lookup.order)
            for name, lookup in record.lookups.items()})
        _deliver(record, alight(aboard, hop.forward_many(payloads)), by_name)
    with phases.phase("server aggregation"):
        for table in tables:
            table._pending.clear()
            table._finish_aggregation()
            if table.scales_by_freq:
                table._divide_by_counts()


def _prepare_verdict(verdict: Verdict, tables: Sequence[ShardedTable], records: list[_Pull],
                     exchanges: list[pooled.PooledExchange]) -> None:
    """This rank's verdict (before the push's first message): the tables a backward reached,
    the shards holding gradient from before, and a bound on what this rank adds to any
    aggregated element (each pull's rows are distinct: one row per element and message)."""
    rows = bound_of([lookup.rows.grad for record in records
                     for lookup in record.lookups.values() if lookup.rows.grad is not None],
                    tables[0].device)
    first = tables[0]
    verdict.prepare(
        names=[table.name for table in tables],
        reached=[table.has_gradient for table in tables],
        stale=sum(bool(table._touched) for table in tables),
        # (on the exchange's device: the verdict travels in its messages)
        bound=rows.to(first.device) + pooled.bound_of_exchanges(exchanges, first.device),
        limit=min(torch.finfo(table.dtype).max for table in tables) / 2,
        world=first.worker.world_size)


def pending_pulls(tables: Sequence[ShardedTable]) -> list[_Pull]:
    """This step's pulls not yet pushed, in the order `push_gradients` takes them (the same
    on every rank)."""
    pulls: dict[int, _Pull] = {}
    for table in tables:
        for record in table._pending:
            pulls.setdefault(id(record), record)
    return list(pulls.values())  # dicts keep insertion order: the same on all ranks


def can_push_early(record: _Pull) -> bool:
    """Whether `start_push` may send ``record``'s gradients: not through a machine's leader
    (that hop merges rows of several workers before the direct exchange can start)."""
    return record.to_leader is None


def start_push(record: _Pull, names: Sequence[str], riders: Sequence[Rider] = ()) -> None:
    """Issue now, without waiting, the exchange of the gradient rows that ``record`` holds
    for the tables ``names`` (their backward must be complete); `push_gradients` waits for
    it and hands the rows to the servers. Every rank must start the same groups of the
    same pulls in the same order (collective). ``riders``: those still waiting ride along."""
    if not can_push_early(record):
        raise InternalError("parallax internal error: an early push through the leader hop")
    names = list(names)
    grads = _gradients_to_push(record, names)
    hop = record.direct if len(names) == len(record.lookups) else record.direct.subset(names)
    hop, payloads = board(riders, hop, {
        name: _by_owner(grads[name], record.lookups[name].order) for name in names})
    record.in_flight.append(hop.start_forward_many(payloads))
    record.launched.extend(names)


def _gradients_to_push(record: _Pull, names: Sequence[str]) -> dict[str, Tensor]:
    """The gradient rows of ``names`` in ``record`` (zeros where backward gave none), with
    their lookup counts as one more column under ``scale_grad_by_freq``."""
    grads = {}
    for name in names:
        lookup = record.lookups[name]
        grad = lookup.rows.grad
        grads[name] = torch.zeros_like(lookup.rows) if grad is None else grad
        if lookup.counts is not None:  # counts travel as one more column of the rows
            grads[name] = lookup_options.with_counts(grads[name], lookup.counts)
    return grads


def _deliver(record: _Pull, received: dict[str, Tensor],
             by_name: dict[str, ShardedTable]) -> None:
    """At the servers: add the gradient rows received for ``record``'s tables."""
    for name, values in received.items():
        table = by_name[name]
        if table.shard is None:
            continue
        lookup = record.lookups[name]
        if table.scales_by_freq:
            values, counts = lookup_options.split_counts(values, table.row_shape)
            table._received_counts.append((lookup.recv_local_rows, counts))
        if table.average:
            values.div_(table.worker.world_size)
        table._accumulate(lookup.recv_local_rows, values, sorted_distinct=lookup.local_sorted)


def _grad_of(param: Tensor) -> Tensor:
    """``param``'s gradient, which the caller has made sure exists."""
    if param.grad is None:
        raise InternalError("a server's gradient was read before it was made; please report it")
    return param.grad
