"""Sparse parameters under the ``allreduce`` architecture (the Horovod way).

Every worker keeps the whole table. A lookup reads the local replica; after backward, every
worker sends its (unique ids, gradient rows) to every other worker — an AllGatherv, done with
``all_to_all_single`` because gloo refuses uneven ``all_gather`` — and each replica sums all
workers' rows into the table's gradient, which the user's own optimizer then applies on every
replica alike.

Batch-dependent embedding options hold over the global batch, so every replica stays equal
and equal to the single-device table: with ``max_norm`` each lookup first exchanges the ids of
all workers and every replica renormalises their union; with ``scale_grad_by_freq`` the lookup
counts travel with the gradient rows and each row is divided by its global count.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from parallax.cluster import WorkerInfo
from parallax.engine.tables import lookup_options, reduction
from parallax.engine.tables.bag_use import BagUse
from parallax.engine.tables.exchange import Hop, Traffic, unique_ids
from parallax.engine.tables.pool import SERIAL, PartitionPool
from parallax.engine.tables.riders import Rider
from parallax.engine.tables.sharding import REPLICATED, Sharding
from parallax.engine.tables.step_context import OwedRows, TableSteps
from parallax.engine.tables.verdict import Verdict
from parallax.errors import InternalError


class ReplicatedTable:
    """A sparse parameter replicated on every worker.

    ``sync="allgatherv"`` exchanges the (ids, rows) of every worker (the ``allreduce``
    architecture's sparse path); ``sync="allreduce"`` AllReduces the whole dense gradient (where
    the hybrid sends a sparse parameter whose measured α makes that cheaper than a PS).
    Implements `parallax.engine.tables.table.Table`.
    """

    on_servers = False
    exchanges = True
    local_aggregation = False  # replicas exchange directly
    sharding: Sharding = REPLICATED  # (every worker pools its own bags from its replica)
    measuring = True  # `Table.measuring`
    pool: PartitionPool = SERIAL  # (no per-partition work)

    @property
    def held(self) -> None:
        return None

    def __init__(self, name: str, param: nn.Parameter, *, worker: WorkerInfo,
                 group: dist.ProcessGroup, traffic: Traffic, sparse_grad: bool, average: bool,
                 sync: str = "allgatherv",
                 batch_dependent: lookup_options.BatchDependent | None = None,
                 steps: TableSteps | None = None):
        lookup_options.check_batch_dependent(name, batch_dependent, sparse_grad)
        self.name = name
        self.batch_dependent = batch_dependent
        # the run's step: this table's lookups owed live there
        # (`parallax.engine.tables.step_context`); a table made alone is its own run
        self.steps = steps if steps is not None else TableSteps()
        self.sync = sync
        self.rows_used: list[int] = []
        self.machine_rows_used: list[int] = []
        self.bag_use = BagUse()
        self.param = param
        self.num_rows = param.shape[0]
        self.row_shape = tuple(param.shape[1:])
        self.dtype = param.dtype
        self.worker = worker
        self.group = group
        self.traffic = traffic
        self.sparse_grad = sparse_grad
        self.average = average
        # the rows any worker's gradient reached since the last zero_grad (`touched_rows`);
        # unknown once the whole gradient was AllReduced
        self._touched: list[Tensor] = []
        self._touched_known = True
        self._touched_distinct = False  # `_touched`'s last entry is sorted and distinct
        self._touched_rows: Tensor | None = None  # `touched_rows`, until the next push
        # the gradient this table wrote and its version then: while ``param.grad`` is that
        # tensor, unchanged, its rows outside `touched_rows` are exactly zero
        self._made: Tensor | None = None
        self._made_version = 0
        # Where no program code sees ``.grad`` (`Runner.step`), the cleared gradient is kept,
        # its touched rows zeroed, for the next step's sum: a table of millions of rows is not
        # zero-filled (and freed) every step for the few hundred a batch touches, the work
        # Horovod's IndexedSlices never do. The own loop turns it off (`BackwardPush.arm`).
        self.reuse_cleared_grad = True
        self._spare: Tensor | None = None
        with torch.no_grad():  # rank 0's initial values, as DDP does for dense parameters
            dist.broadcast(param.data, src=0, group=group)

    def pool_bags(self, ids: Tensor, offsets: Tensor | None, per_sample_weights: Tensor | None, *,
                  mode: str, padding_idx: int | None, include_last_offset: bool) -> Tensor:
        raise InternalError(f"'{self.name}' is replicated: its bags are pooled from the rows "
                            "it looks up, not on an owner; please report it")

    def lookup(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """Rows of the local replica, as `ShardedTable.lookup` returns them."""
        unique, inverse, bad_id = unique_ids(ids, self.num_rows, self.name, self.worker.rank)
        options = self.batch_dependent
        scales = lookup_options.scales_by_freq(options)
        if scales and torch.is_grad_enabled():
            lookup_options.check_one_lookup(self.name, self.worker.rank,
                                            self.steps.count_lookup(self.name))
        # Every rank learns of a bad id on any rank (a count exchange), so none waits alone;
        # with max_norm the ids themselves go to every replica.
        world = self.worker.world_size
        renorm = options if options is not None and options.max_norm is not None else None
        hop = Hop.open([unique.numel() if renorm is not None else 0] * world, group=self.group,
                       traffic=self.traffic, name=self.name, num_rows=self.num_rows,
                       bad_id=bad_id, device=self.param.device)
        if renorm is not None and renorm.max_norm is not None:
            everyone = hop.forward(unique.repeat(world))
            with torch.no_grad():
                torch.embedding_renorm_(self.param.detach(), everyone, renorm.max_norm,
                                        renorm.norm_type)
        rows = self.param.detach()[unique].clone()
        if torch.is_grad_enabled():
            rows.requires_grad_(True)
            counts = (torch.bincount(inverse.reshape(-1), minlength=unique.numel())
                      if scales else None)
            self.steps.owe(self.name, OwedRows(unique, rows, counts))
        return rows, inverse

    def read_rows(self, ids: Tensor, source: Tensor | None = None) -> Tensor:
        return self.param.detach()[ids]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradient and the looked-up rows' gradients; lookups not yet pushed stay
        (as `ShardedTable.zero_grad`)."""
        for lookup in self.steps.owed(self.name):
            lookup.rows.grad = None
        self.steps.forget_lookups(self.name)
        self._keep_spare()
        self.param.grad = None
        self._touched, self._touched_known, self._touched_rows = [], True, None
        self._made = None

    def _keep_spare(self) -> None:
        """Keep the gradient being cleared as the next sum's zeros, where that is cheaper and
        unseen: the exchange's own dense gradient, unchanged, its touched rows known."""
        if not self.reuse_cleared_grad or self.sparse_grad or not self.grad_is_ours():
            return
        rows = self.touched_rows()
        grad = self.param.grad
        if rows is None or grad is None or rows.numel() * 4 > self.num_rows:
            return  # zeroing that many rows costs about what a fresh fill does
        self._spare = grad.index_fill_(0, rows, 0)

    def touched_rows(self) -> Tensor | None:
        """The (sorted, distinct) rows whose aggregated gradient can be non-zero: every
        worker's ids since the last zero_grad; None when not known: a whole-gradient
        AllReduce (``sync="allreduce"``), or a gradient that is not the one the exchange
        wrote, unchanged (the program used the whole weight outside its lookups, or changed
        ``.grad`` in place: a weight-decay term, noise)."""
        if not self._touched_known or (self.param.grad is not None
                                       and not self.grad_is_ours()):
            return None
        if self._touched_rows is None:
            if len(self._touched) == 1 and self._touched_distinct:
                self._touched_rows = self._touched[0]  # sorted and distinct already
            else:
                self._touched_rows = (torch.unique(torch.cat(self._touched)) if self._touched
                                      else torch.empty(0, dtype=torch.long,
                                                       device=self.param.device))
        return self._touched_rows

    def grad_is_ours(self) -> bool:
        """Whether ``.grad`` is the gradient the exchange wrote, unchanged since."""
        grad = self.param.grad
        return grad is not None and grad is self._made and grad._version == self._made_version

    def grad_rescaled(self) -> None:
        """The engine scaled the gradient in place (clipping) while `grad_is_ours`: zero rows
        stayed zero, so `touched_rows` still holds."""
        if self._made is not None and self.param.grad is self._made:
            self._made_version = self._made._version

    @staticmethod
    def push_together(tables: Sequence[ReplicatedTable],
                      verdict: Verdict | None = None,
                      riders: Sequence[Rider] = ()) -> None:
        """One exchange per table (each has its own sync); the verdict rides elsewhere."""
        for table in tables:
            table.push_gradients()

    def assign(self, weight: Tensor) -> None:
        """Set the replica's values (every rank passes the same ``weight``)."""
        with torch.no_grad():
            self.param.copy_(weight.detach().view_as(self.param))

    @property
    def replica(self) -> nn.Parameter:
        """The parameter itself: the user's optimizer updates it on every worker."""
        return self.param

    def pending_rows(self) -> list[Tensor]:
        """The rows of the lookups whose gradients are not pushed yet."""
        return [lookup.rows for lookup in self.steps.owed(self.name)]

    def push_after_backward(self) -> None:
        """The own loop's backward ended (`parallax.engine.tables.backward_push`): push now, so
        that ``.grad`` is the aggregated gradient until the step; the lookups stay pending with
        their gradients cleared (a retained graph's next backward adds to them again)."""
        lookups = list(self.steps.owed(self.name))
        self.steps.current.summed_after_backward.discard(self.name)
        self.push_gradients()
        for lookup in lookups:
            lookup.rows.grad = None
            self.steps.owe(self.name, lookup)
        self.steps.current.summed_after_backward.add(self.name)

    def push_gradients(self) -> None:
        """AllGatherv of every lookup's (ids, rows); each replica sums them into its grad."""
        summed = self.name in self.steps.current.summed_after_backward
        pending = self.steps.take_owed(self.name)
        if summed:  # every backward's rows went at its end
            return
        world = self.worker.world_size
        if pending and self.measuring:
            used = torch.unique(torch.cat([lookup.ids for lookup in pending]))
            self.rows_used.append(int(used.numel()))
        if self.sync == "allreduce":
            self._allreduce(pending)
            return
        ids_parts, row_parts = [], []
        for unique, rows, counts in pending:
            grad = rows.grad if rows.grad is not None else torch.zeros_like(rows)
            if counts is not None:  # counts travel as one more column of the rows
                grad = lookup_options.with_counts(grad, counts)
            if world == 1:  # nothing to gather: this rank's rows are every rank's
                ids_parts.append(unique)
                row_parts.append(grad)
                continue
            hop = Hop.open([unique.numel()] * world, group=self.group, traffic=self.traffic,
                           name=self.name, num_rows=self.num_rows, device=self.param.device)
            ids_parts.append(hop.forward(unique.repeat(world)))
            row_parts.append(hop.forward(grad.repeat(world, *[1] * (grad.dim() - 1))))
        if not ids_parts:
            return
        ids, rows = torch.cat(ids_parts), torch.cat(row_parts)
        if self.param.grad is not None and not self.grad_is_ours():
            self._touched_known = False  # autograd reached the whole weight, or the program
        self._touched.append(ids)
        # one lookup's unique ids from one rank (a world of one): no unique of them needed
        self._touched_distinct = world == 1 and len(ids_parts) == 1
        self._touched_rows = None
        counts = None
        if self._scales_by_freq:
            rows, counts = lookup_options.split_counts(rows, self.row_shape)
        if self.average and world > 1:  # (x / 1 is x: no pass over the rows for it)
            rows = rows / world
        if self.sparse_grad:
            grad = torch.sparse_coo_tensor(ids.unsqueeze(0), rows, self.param.shape,
                                           check_invariants=False).coalesce()
        else:
            spare, self._spare = self._spare, None
            grad = (spare if spare is not None else torch.zeros_like(self.param)).index_add_(
                0, ids, rows)
            if counts is not None:
                lookup_options.divide_by_counts(grad, torch.zeros(self.num_rows, dtype=self.dtype,
                                                   device=ids.device).index_add_(0, ids, counts))
        # accumulated onto a gradient no zero_grad cleared, as autograd does
        self.param.grad = grad if self.param.grad is None else self.param.grad + grad
        self._made, self._made_version = self.param.grad, self.param.grad._version

    @property
    def _scales_by_freq(self) -> bool:
        return lookup_options.scales_by_freq(self.batch_dependent)

    def _allreduce(self, pending: list[OwedRows]) -> None:
        self._touched_known = False  # only this worker's rows are known here
        grad = torch.zeros_like(self.param)
        total = torch.zeros(self.num_rows, dtype=self.dtype, device=self.param.device)
        for unique, rows, counts in pending:
            if rows.grad is not None:
                grad.index_add_(0, unique, rows.grad)
            if counts is not None:
                total.index_add_(0, unique, counts.to(self.dtype))
        # The counts ride in the same AllReduce, as one more column.
        payload = lookup_options.with_counts(grad, total) if self._scales_by_freq else grad
        all_to_all = reduction.by_all_to_all(payload, self.group)
        reduction.account(payload, traffic=self.traffic, name=self.name, all_to_all=all_to_all)
        reduction.all_reduce(payload, group=self.group, all_to_all=all_to_all)
        if self._scales_by_freq:
            grad, total = lookup_options.split_counts(payload, self.row_shape)
            grad = grad.contiguous()
        if self.average:
            grad /= self.worker.world_size
        if self._scales_by_freq:
            lookup_options.divide_by_counts(grad, total)
        # accumulated onto a gradient no zero_grad cleared, as autograd does
        self.param.grad = grad if self.param.grad is None else self.param.grad + grad
        self._made, self._made_version = self.param.grad, self.param.grad._version

    def grad_norm_squared(self) -> Tensor:
        """Zero: a replicated gradient counts once, with the dense ones (see `dense_grads`)."""
        return torch.zeros((), dtype=torch.float64, device=self.param.device)

    def scale_grad(self, factor: Tensor) -> None:
        """Nothing: the runner scales replicated gradients with the dense ones."""

    def clamp_grad(self, value: float) -> None:
        """Nothing: the runner clamps replicated gradients with the dense ones."""

    def full_weight(self, source: Tensor | None = None) -> Tensor:
        return self.param.detach().clone()

    @property
    def shard(self) -> None:
        """No server holds a shard: the user's optimizer updates the replicas."""
        return None
