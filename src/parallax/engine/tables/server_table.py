"""Parameters on parameter servers: row partitioning, a server's rows and the arithmetic on the
gradient rows it receives (the pull and push themselves: `parallax.engine.tables.row_exchange`).

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

import torch
import torch.distributed as dist
from torch import Tensor, nn

from parallax.cluster import WorkerInfo
from parallax.engine.tables import lookup_options, pooled
from parallax.engine.tables.bag_use import BagUse
from parallax.engine.tables.exchange import Traffic, all_to_all, unique_ids
from parallax.engine.tables.id_dedup import Distinct, IdRequests
from parallax.engine.tables.partitioning import RowPartitioning
from parallax.engine.tables.pool import SERIAL, PartitionPool
from parallax.engine.tables.reservations import Reservations
from parallax.engine.tables.riders import Rider
from parallax.engine.tables.row_exchange import (
    pull,
    push_gradients,
    read_rows_direct,
    rows_pulled_ahead,
)
from parallax.engine.tables.sharding import ROWS, Sharding
from parallax.engine.tables.step_context import Pull, TableSteps
from parallax.engine.tables.verdict import Verdict
from parallax.errors import ArgumentError, InternalError, SparseIdError

__all__ = ["RowPartitioning", "ShardedTable", "SparseIdError"]


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
    #: how its rows are held and read (`parallax.engine.tables.sharding`): set where the
    #: layout is built (`Config`) or by the planner after the warm-up. Pooled by columns, the
    #: table is the view of the program's ``R x d`` one as ``R*K x d/K`` rows, slice k as
    #: partition k
    sharding: Sharding = ROWS
    measuring = True  # `Table.measuring`
    #: pulled and pushed by rows in the step's exchange: it may travel in a table group
    #: (`parallax.engine.tables.table_group.group_key` says whether it does)
    exchanged_as_rows = True

    @property
    def held(self) -> ShardedTable:
        return self

    def __init__(self, name: str, weight: Tensor, *, num_partitions: int, worker: WorkerInfo,
                 group: dist.ProcessGroup, traffic: Traffic, sparse_grad: bool, average: bool,
                 local_aggregation: bool = False, first_server: int = 0,
                 batch_dependent: lookup_options.BatchDependent | None = None,
                 initial_rows: Callable[[Tensor], Tensor] | None = None,
                 steps: TableSteps | None = None, divides_on_arrival: bool = True,
                 id_requests: IdRequests | None = None):
        if weight.dim() < 1:
            raise ArgumentError(f"parameter '{name}' must have rows (dim >= 1), got a scalar")
        lookup_options.check_batch_dependent(name, batch_dependent, sparse_grad)
        self.name = name
        # max_norm: owners renormalise the rows of every pull (all workers' ids) before
        # serving them; scale_grad_by_freq: workers push their id counts with the gradient
        # rows, owners divide each aggregated row by its count over the global batch.
        self.batch_dependent = batch_dependent
        # (an attribute, not a property: the pull, the lookup and the push ask each step)
        self.scales_by_freq = lookup_options.scales_by_freq(batch_dependent)
        # the run's step (what its pulls owe: `parallax.engine.tables.step_context`), shared
        # by the run's tables; a table made alone is its own run
        self.steps = steps if steps is not None else TableSteps()
        # (shard rows, lookup counts) received by this push (scale_grad_by_freq)
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
        # whether its servers take the average as each worker's gradient rows arrive (else
        # after the aggregation, where `Config.after_aggregation` puts it)
        self.divides_rows_on_arrival = average and divides_on_arrival
        # which side deduplicates a step's ids (`Config.id_dedup`)
        self.id_requests: IdRequests = id_requests if id_requests is not None else Distinct()
        # (with one worker per machine every worker is its own leader: nothing to merge, and
        # the leader hop would only add collectives)
        self.local_aggregation = (local_aggregation
                                  and worker.world_size > len(worker.server_ranks))
        self.partitioning = RowPartitioning(self.num_rows, num_partitions, worker.server_ranks,
                                            first_server)
        # room for this table's ids in a pull's one message (reset when the rows move)
        self.reservations = Reservations(worker.world_size)
        self.shard: nn.Parameter | None = None
        # the table group whose store holds the shard's rows (set by the group:
        # `parallax.engine.tables.table_group`), for the servers' update of them together
        self.store_group: object | None = None
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
        # Whether the single-device parameter would have a .grad now: a backward reached
        # this table's rows on this worker since the last clear to None (`has_gradient`), on
        # any worker (`gradient_anywhere`, agreed by the runner before the update). Without
        # one the servers' optimizer skips the table, as torch skips a .grad of None (Adam
        # would otherwise move every row with a zero gradient).
        self.has_gradient = False
        self.gradient_anywhere = True
        # the rooms reserved for pooled calls' ids, per exchange key (`pooled.pool_many`)
        self.pooled_reservations: dict[str, Reservations] = {}
        # (shard rows, gradient rows) received by this push, summed by `finish_aggregation`
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
        self.store_group = None  # (its rows are its own again)
        self._touched, self._touched_unique = [], None
        self.blocks = self.partitioning.shard_blocks(
            self.worker.server_ranks.index(self.worker.rank)) or [(0, 0)]
        if len(self.blocks) == 1:
            self.parts = [shard]
        else:
            self.parts = [nn.Parameter(shard.data[start:stop], requires_grad=shard.requires_grad)
                          for start, stop in self.blocks]

    @property
    def leader(self) -> int:
        """This worker's machine's leader (local aggregation's merging rank)."""
        return self.worker.server_ranks[self.worker.machine]

    def empty_rows(self, count: int) -> Tensor:
        """``count`` uninitialised rows of this table's shape, dtype and device."""
        return torch.empty((count, *self.row_shape), dtype=self.dtype, device=self.device)

    # ---- forward: pull ------------------------------------------------------------------
    def lookup(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """Pull the rows ``ids`` needs. Returns ``(rows, inverse)`` with ``rows[inverse]`` the
        looked-up values; the gradient of ``rows`` is what `push_gradients` sends back. Served
        from the rows `pull` prefetched for this step when there are any."""
        if self.scales_by_freq and torch.is_grad_enabled():
            lookup_options.check_one_lookup(self.name, self.worker.rank,
                                            self.steps.count_lookup(self.name))
        prefetched = self.steps.current.prefetched
        if self.name not in prefetched:
            return pull([self], [ids])[0]
        held = prefetched[self.name]
        # the ids a lookup was read from ahead: the pull's leaf rows and inverse serve it as
        # they serve a lookup pulled on its own (no second unique, search or gather)
        ahead = held.inverse_of(ids)
        if ahead is not None:
            return held.rows, ahead
        unique, inverse, bad_id = unique_ids(ids, self.num_rows, self.name, self.worker.rank)
        return rows_pulled_ahead(held.ids, held.rows, unique, self.name, self.worker.rank,
                                 bad_id=bad_id), inverse

    def forget_prefetched(self) -> None:
        """The forward that read rows ahead has ended: the next one pulls its own."""
        prefetched = self.steps.current.prefetched
        if self.name in prefetched:  # (no call: every forward ends so)
            del prefetched[self.name]

    def pool_bags(self, ids: Tensor, offsets: Tensor | None, per_sample_weights: Tensor | None, *,
                  mode: str, padding_idx: int | None, include_last_offset: bool) -> Tensor:
        """``F.embedding_bag`` of this table computed on its owner: this rank's pooled rows
        (collective; a table with ``pools`` only, `parallax.engine.tables.pooled`)."""
        call = pooled.bag_call(self, ids, offsets, per_sample_weights, mode=mode,
                               padding_idx=padding_idx, include_last_offset=include_last_offset)
        if self.steps.current.pooled_ahead.get(self.name):  # (`pooled.pool_ahead`)
            return pooled.serve_ahead(call)
        return pooled.pool_many([call])[0]

    def read_rows(self, ids: Tensor, source: Tensor | None = None) -> Tensor:
        """Current values of rows ``ids`` (collective; for export and migration), from the
        shards or from ``source``, a tensor each server holds shaped like its shard."""
        with torch.no_grad():
            unique, inverse = torch.unique(ids.reshape(-1), return_inverse=True)
            rows = read_rows_direct(self, unique, source)
        if unique.numel() == ids.numel() and torch.equal(unique, ids.reshape(-1)):
            return rows.view(*ids.shape, *self.row_shape)  # ids in order (a move's): no copy
        return rows[inverse].view(*ids.shape, *self.row_shape)

    # ---- backward: push ------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the aggregated gradient and the gradients the pulled rows hold, as
        ``zero_grad`` clears leaves on one device. Pulls not yet pushed stay: a backward may
        still come (a forward, then ``zero_grad``, then the backward is a valid program).
        ``set_to_none``: the single-device gradient is None until the next backward (else
        zeros, and the optimizer still steps the table)."""
        if set_to_none:
            self.has_gradient = False
        name, step = self.name, self.steps.current
        for record in step.pulls:  # (loops, not calls: every step clears every table)
            if name in record.lookups:
                record.lookups[name].rows.grad = None
        for exchange in step.pooled:
            for call, out in zip(exchange.calls, exchange.outs, strict=True):
                if call.table is self:
                    out.grad = None
        if name in step.prefetched:
            del step.prefetched[name]
        self._received.clear()
        self._received_counts.clear()
        lookups = self.steps.lookups
        if name in lookups:  # (`TableSteps.forget_lookups`, inline: every step, every table)
            del lookups[name]
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

    def record_usage(self, pulls: Sequence[Pull]) -> None:
        """Note what this step's ``pulls`` (those being pushed) looked up of this table: whether
        a backward reached its rows, and how many rows it used (`rows_used`)."""
        lookups = [pull.lookups[self.name] for pull in pulls if self.name in pull.lookups]
        if not lookups:
            return
        self.has_gradient = self.has_gradient or any(
            lookup.rows.grad is not None for lookup in lookups)
        if not self.measuring:
            return
        ids = torch.cat([lookup.ids for lookup in lookups])
        self.rows_used.append(int(torch.unique(ids).numel()))
        if self.local_aggregation and self.worker.rank == self.leader:
            self.machine_rows_used.append(sum(lookup.merged_count for lookup in lookups))

    @property
    def sums_as_rows_arrive(self) -> bool:
        """Whether gradient rows go straight into the shard's dense gradient as they arrive
        (one partition, dense gradients), so that rows repeated in one arrival cost nothing
        more than distinct ones (`accumulate`)."""
        return not self.sparse_grad and len(self.parts) == 1

    @property
    def holds_gradient_rows(self) -> bool:
        """Whether rows of this server's shard received gradient since the last zero_grad."""
        return bool(self._touched)

    def accumulate(self, local_rows: Tensor, grad_rows: Tensor,
                   touched: Tensor | None = None, sorted_distinct: bool = False) -> None:
        """At a server: add ``grad_rows`` at shard rows ``local_rows`` (repeats allowed);
        ``touched``: those rows, distinct, where the caller has them; ``sorted_distinct``:
        ``local_rows`` are sorted and distinct already. `finish_aggregation` ends a push's
        sums."""
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

    def note_touched(self, rows: Tensor) -> None:
        """At a server: shard rows ``rows`` (sorted, distinct) received gradient that was
        summed elsewhere (into this shard's gradient, by its table group)."""
        self._touched_sorted = not self._touched
        self._touched.append(rows)
        self._touched_unique = None

    def serve(self, ids: Tensor, *, lookup: bool, source: Tensor | None,
              ) -> tuple[Tensor, Tensor]:
        """At a server: the shard rows of the ``ids`` it received, and their values (from
        ``source``, a tensor shaped like the shard, where given). A ``lookup``'s rows of a
        ``max_norm`` table are first renormalised in place, as ``F.embedding`` does."""
        local = self.shard_rows_of(ids)
        if self.shard is not None and self.before_read is not None:
            self.before_read(local)  # deferred steps first (values and optimizer state)
        held = source if source is not None else self.shard
        if held is None:
            return local, self.empty_rows(0)
        options = self.batch_dependent
        if lookup and options is not None and options.max_norm is not None:
            with torch.no_grad():
                torch.embedding_renorm_(held.detach(), local, options.max_norm,
                                        options.norm_type)
        return local, held.detach().index_select(0, local)

    def receive_counts(self, local_rows: Tensor, counts: Tensor) -> None:
        """At a server: one sender's lookup counts of shard rows ``local_rows``
        (scale_grad_by_freq), divided out by `finish_aggregation`."""
        self._received_counts.append((local_rows, counts))

    def finish_aggregation(self) -> None:
        """The end of a push at a server: the gradient rows received summed, and, under
        scale_grad_by_freq, divided by their counts over the global batch."""
        self._sum_received()
        if self.scales_by_freq:
            self._divide_by_counts()

    def _sum_received(self) -> None:
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
            values = self.empty_rows(0)
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
    def one_partition(self) -> bool:
        """Whether this server's shard is one partition (from the shard's first row)."""
        return len(self.blocks) == 1 and self.blocks[0][0] == 0

    def shard_rows_of(self, ids: Tensor) -> Tensor:
        """The rows of this server's shard that hold ``ids`` (ids this rank owns)."""
        if self.one_partition:
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
        if self.one_partition:  # the shard's rows are the partition's
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

    def aggregated_values(self) -> Tensor:
        """This server's aggregated gradient values that can be non-zero, as one vector (a
        dense gradient's touched rows, a sparse one's values; empty off the servers):
        what `parallax.engine.tables.after_aggregation` sends to the workers."""
        parts = [self._readable(grad).reshape(-1) for grad in self._gradients()]
        if not parts:
            return torch.empty(0, dtype=self.dtype, device=self.device)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def set_aggregated_values(self, values: Tensor) -> None:
        """`aggregated_values`' places set to ``values`` (as many, in its order)."""
        at = 0
        for grad in self._gradients():
            rows = self._rows_to_read(grad)
            target = self._readable(grad)
            piece = values[at:at + target.numel()].view_as(target)
            at += target.numel()
            if rows is None:
                target.copy_(piece)  # (a sparse one's values, or every row: in place)
            else:
                grad[rows] = piece

    def _readable(self, grad: Tensor) -> Tensor:
        """The values of an aggregated ``grad`` that can be non-zero."""
        if grad.is_sparse:
            return grad._values()
        rows = self._rows_to_read(grad)
        return grad if rows is None else grad[rows]

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


def _grad_of(param: Tensor) -> Tensor:
    """``param``'s gradient, which the caller has made sure exists."""
    if param.grad is None:
        raise InternalError("a server's gradient was read before it was made; please report it")
    return param.grad
