"""`Runner`: one synchronous hybrid training step, and export back to a single-device model.

Step on worker r: forward (sparse lookups pull rows from the servers) -> loss -> backward
(DDP AllReduces the dense gradients) -> push sparse gradient rows to their servers, which sum
them over workers -> global gradient norm (dense part + every server's partial norm) -> clip ->
dense update on every worker with the user's optimizer, sparse update on each server with the
same optimizer class over its shard.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from parallax.checkpoint import sharded as checkpoint
from parallax.checkpoint.export import export_running
from parallax.cluster import PLAN_ONLY_ENV, PLAN_WARMUP_ENV, WorkerInfo
from parallax.collective import agree, first_difference
from parallax.config import SERVER_SYNCS, Config
from parallax.engine import handles
from parallax.engine.async_table import AsyncTable
from parallax.engine.async_training import AsyncTraining
from parallax.engine.dense_sync import DenseSyncState, codec_of, wrap_dense
from parallax.engine.dense_sync.server_sync import ServerSync, build_server_sync
from parallax.engine.early_push import EarlyPush
from parallax.engine.exchange import Traffic
from parallax.engine.grad_norm import clip_by_global_norm, find_nonfinite
from parallax.engine.handles import release
from parallax.engine.phases import PHASES, STATS_KEY, TIMELINE_ENV, PhaseClock
from parallax.engine.pool import default_threads, shared_pool
from parallax.engine.progress import Progress, is_collective_failure
from parallax.engine.server_table import ShardedTable, prefetch
from parallax.engine.shard_optimizer import (
    ShardOptimizer,
    check_lazy,
    check_per_shard,
    is_per_row,
    local_load_state_dict,
    local_state_dict,
    parameter_ids,
    rebuild_constructor_state,
)
from parallax.engine.table import Table, push_all
from parallax.errors import (
    ArgumentError,
    ArgumentTypeError,
    NonFiniteError,
    PlanComplete,
    UnevenInputsError,
    UnsupportedProgramError,
    UsageError,
)
from parallax.metrics import MetricsLog, Window
from parallax.model.detect import SparseUse, find_sparse_parameters
from parallax.model.exactness import check_exact
from parallax.model.lookahead import build_id_program
from parallax.model.meta_init import forget, materialise_kept
from parallax.model.stand_ins import executed_copy, mirror
from parallax.parallelism import Parallelism, build_parallelism
from parallax.partitions.repartition import repartition
from parallax.partitions.tuner import PartitionTuner, SearchRecord, build_tuner
from parallax.planning.architectures import architecture_of, build_layout
from parallax.planning.memory import MemoryEstimate, predict_memory
from parallax.planning.plan import Plan
from parallax.planning.sparsity import Sparsity, measure, move_to_allreduce
from parallax.session import check_same_everywhere, on_shutdown, shutdown
from parallax.verify.record import AfterStep

LossFn = Callable[[Any, Any], Tensor]
_FORWARD, _UPDATE, _EXPORT = 1, 2, 3  # what a rank is calling, in _check_phase
_COLLECTIVE_EXPORT = (
    "model.state_dict() is collective (it gathers the servers' rows): call it on every rank "
    "and save on one, e.g. state = model.state_dict(); then if rank == 0: torch.save(state, "
    "path). The DDP habit of calling it on rank 0 alone cannot work here.")
log = logging.getLogger("parallax")


class Runner:
    """Trains ``model`` data-parallel; every public method is collective (call it on all ranks).

    The runner executes a structural copy of the user's ``model`` that shares its dense
    parameters and buffers, so the dense parameters the user holds are the ones being trained.
    A parameter the servers hold is released in the user's model (a storage-less handle on the
    ``meta`` device, `parallax.engine.handles`): `state_dict` brings its values back.
    """

    def __init__(self, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer],
                 loss_fn: LossFn, *, worker: WorkerInfo, config: Config,
                 sparse_group: dist.ProcessGroup):
        self.model = model
        self.optimizers = list(optimizers)
        self.loss_fn = loss_fn
        self.worker = worker
        self.config = config
        self.device = worker.device
        self.group = sparse_group  # every rank of the run (checkpoints agree through it)
        check_same_everywhere(model, config, worker, sparse_group)
        # Where every rank is, in the job's store: a failed collective names who is missing.
        self.progress = (Progress(worker.rank, worker.world_size, config.collective_timeout_s)
                         if worker.world_size > 1 else None)
        # where each step's time goes (runner.stats()["step phases"]; parallax run --timeline)
        self.phases = PhaseClock(worker.rank, os.environ.get(TIMELINE_ENV) or None)
        on_shutdown(self.phases.write)
        # Config.log_dir: TensorBoard from rank 0; `headline` for a progress bar
        self.metrics = MetricsLog(config.log_dir, rank=worker.rank, every=config.log_every_steps)
        on_shutdown(self.metrics.close)
        self._headline = Window()
        self._step_loss: float | None = None  # Runner.step's, for the metrics
        self._step_targets: float | None = None
        self._last_targets: float | None = None  # the latest step's, all workers
        # asynchronous: the workers' steps summed at each window's start
        self._global_steps_at = {"metrics": 0, "headline": 0}
        self.sparse_uses: dict[str, SparseUse] = find_sparse_parameters(model)
        check_exact(model, self.sparse_uses, config)
        self.architecture = architecture_of(config)
        # whether sparse exchanges go through each machine's leader (the hybrid may turn it
        # off once α is measured: `Architecture.keeps_local_aggregation`)
        self.local_aggregation = self.architecture.aggregates_locally(config)
        # Built in parallax.meta_init: what every worker keeps whole gets its values now; the
        # servers' tables stay storage-less here (each server makes its own rows).
        for param in materialise_kept(model, self.architecture.server_held(model,
                                                                          self.sparse_uses)):
            rebuild_constructor_state(self.optimizers, param)
        # in place: the optimizer's Parameter objects stay the same; meta ones have no values
        model._apply(lambda t: t if t.device.type == "meta" else t.to(self.device))
        params = dict(model.named_parameters())
        self._params = params  # by name; the objects never change (handles swap in place)
        self.traffic = Traffic(worker.rank, worker.machine_of_rank)
        self.layout = build_layout(model, self.sparse_uses, config=config, worker=worker,
                                   group=sparse_group, traffic=self.traffic)
        # Config.sync "async"/"async-sparse": the server-held tables are pulled and pushed by
        # point-to-point messages to server threads (parallax.engine.async_training)
        self.asynchronous: AsyncTraining | None = None
        if config.sync != "sync":
            self._check_async_program()
            self.asynchronous = AsyncTraining(
                {n: t for n, t in self.layout.all_tables().items() if t.on_servers},
                worker=worker, max_staleness=config.max_staleness,
                timeout_s=config.collective_timeout_s, traffic=self.traffic)
            for name, table in self.asynchronous.tables.items():
                held = name in self.layout.sparse
                kind = self.layout.sparse if held else self.layout.pulled_whole
                kind[name] = table
        self.tables = self.layout.sparse
        check_per_shard(self.optimizers, self.architecture.server_held(model, self.sparse_uses))
        if config.lazy_sparse_updates:
            check_lazy(self.optimizers, {n: params[n] for n in self.sparse_uses})
        self.sparsity: dict[str, Sparsity] = {}
        self._decisions: dict[str, str] = (
            dict.fromkeys(self.sparse_uses, "lazy: touched rows only")
            if config.lazy_sparse_updates else {})
        self._steps = 0  # in this process (the warm-up counts these)
        self.global_step = 0  # since the start of training, across resumes
        self.skipped_steps = 0  # steps whose update Config.nonfinite="skip" skipped
        self._tables_squared: Tensor | None = None  # tables' squared gradient norm, this step
        self._tuner: PartitionTuner | None = None  # built once the tables exist
        # Under ``parallax plan`` the warm-up is all that runs.
        self._warmup_steps = int(os.environ.get(PLAN_WARMUP_ENV,
                                                config.sparsity_warmup_steps))
        if config.sync == "async":  # measuring α is a collective: no barrier in async runs
            self._warmup_steps = 0
        self._build_plan()
        shared = config.parallelism == "data"  # model parallelism rewrites the layers
        executed = executed_copy(model, self.sparse_uses, lambda name: self.tables[name],
                                 share_modules=shared)
        # what the program sets on its module tree after distribute reaches what runs
        self._mirror = mirror(model, executed, shared_modules=shared)
        # Config.parallelism: "model"/"2d" split the linear layers over model groups here
        # (in place; the user's optimizers are re-pointed at the split parameters).
        self.parallelism: Parallelism = build_parallelism(
            model, config, worker=worker, group=sparse_group, traffic=self.traffic)
        executed = self.parallelism.prepare(executed, model, self.optimizers)
        self._executed = executed
        # All lookups' ids from the inputs, when the model allows: one pull for all tables.
        self._id_program = build_id_program(executed) if self.tables else None
        # Parameters every worker holds whole, with a gradient AllReduced (DDP) or exchanged
        # by their table, updated by the user's optimizer. (Under ps/optps the dense ones are
        # pulled from the servers instead: they get no gradient here.)
        self.replicated_parameters = [p for p in executed.parameters()
                                      if p.requires_grad and not self.parallelism.is_sharded(p)]
        self._split_parameters = [p for p in executed.parameters()
                                  if self.parallelism.is_sharded(p)]
        self.replicated_parameters += [t.replica for t in self.tables.values()
                                       if t.replica is not None]
        self.module = executed
        # Config.dense_sync "plump"/"slim": each worker trains its own dense copy, whose
        # updates go through servers at the end of a step (`_end_round`); no DDP.
        self.server_sync: ServerSync | None = None
        self._hook_state: DenseSyncState | None = None
        if self.layout.uses_ddp and config.dense_sync in SERVER_SYNCS:
            self.server_sync = build_server_sync(
                executed, self.optimizers, sync=str(config.dense_sync), slim=config.slim,
                codec=codec_of(config.qsgd), rank=worker.rank, world=worker.world_size,
                server_ranks=worker.server_ranks, group=self.group, traffic=self.traffic,
                average=config.average_dense, seed=config.seed)
        elif self.layout.uses_ddp and not self.parallelism.replaces_ddp:
            self.module, self._hook_state = wrap_dense(
                executed, device=self.device, sync=config.dense_sync,
                average=config.average_dense, find_unused_parameters=config.find_unused_parameters,
                traffic=self.traffic, qsgd=config.qsgd, seed=config.seed)
        on_shutdown(self._release_ddp)
        self.pool = shared_pool(config.server_threads or default_threads())
        for table in self.layout.all_tables().values():
            table.pool = self.pool
        self.shard_optimizer = ShardOptimizer(self.optimizers, {
            id(params[name]): _held(table) for name, table in self.layout.all_tables().items()
            if table.shard is not None
        }, self.pool)
        self._whole_pulls = {name: (table, torch.arange(table.num_rows, device=self.device),
                                    params[name].shape)
                             for name, table in self.layout.pulled_whole.items()}
        self.last_grad_norm: float | None = None
        # Runner.step's gradient rows leave during its backward (Config.overlap_push)
        self._early = (EarlyPush(worker.rank)
                       if config.overlap_push and self.asynchronous is None else None)
        # The servers hold these now, with the state the user's optimizer had for them: the
        # user's copies would be stale full tables in every process (parallax.engine.handles).
        for name, table in self.layout.all_tables().items():
            if table.on_servers:
                self.shard_optimizer.adopt_user_state(_held(table), params[name],
                                                      self.optimizers)
                release(params[name], name=name, device=self.device, rank=worker.rank)
                forget(params[name])  # a meta_init recipe, replayed by the servers already
        self._tuner = self._build_tuner()
        self._batch_signature: Any = None
        # the current step (see "training" below)
        self._in_round = self._synced = self._applies = False
        self._stepped: set[int] = set()  # ids of the optimizers that stepped in it
        self._round_began = 0.0
        self._explaining = 0
        self.checks_phases = False  # set by parallax.distribute (see _check_phase)
        self.verify_recorder: AfterStep | None = None  # set under parallax verify
        self._last_save = time.monotonic()
        if config.checkpoint_dir is not None and config.resume:
            self._resume_from_newest(config.checkpoint_dir)
        if self.asynchronous is not None:
            self.asynchronous.start(self.shard_optimizer, self.global_step)
            self._global_steps_at = dict.fromkeys(self._global_steps_at,
                                                  self.asynchronous.global_steps())
            # held strongly: another rank's server waits for this one's stop message
            on_shutdown(functools.partial(AsyncTraining.close, self.asynchronous))
            if self.progress is not None and config.sync == "async":
                self.progress.ends_freely = True  # workers finish on their own clocks

    def _release_ddp(self) -> None:
        """At `parallax.shutdown`: drop the DDP wrapper (see there why); the runner cannot
        train after shutdown anyway."""
        self.module = self._executed

    # ---- training ------------------------------------------------------------------------
    # A step is a round: training forwards (one, or several accumulated) -> backward(s) ->
    # `sync_gradients` (push, finiteness, Config clipping; once) -> each optimizer's update
    # (`apply_update`) -> `_end_round` once every optimizer has stepped (or at the next
    # forward). `step` drives a round itself; `parallax.distribute` lets the user's loop
    # drive the same round through the model, `optimizer.step()` and `clip_grad_norm_`.
    def forward(self, inputs: Any) -> Any:
        """The model's output for ``inputs`` (a tensor, a tuple of positional args or a dict of
        keyword args). Collective: sparse rows are pulled from the servers."""
        args, kwargs = ((), inputs) if isinstance(inputs, dict) else (
            (tuple(inputs), {}) if isinstance(inputs, (tuple, list)) else ((inputs,), {}))
        return self.forward_call(args, kwargs)

    def forward_call(self, args: tuple, kwargs: dict) -> Any:
        """``model(*args, **kwargs)`` as the user's module returns it (collective). Under
        autograd it belongs to the current step: its rows' gradients are pushed by the next
        `sync_gradients`."""
        args, kwargs = _to_device(args, self.device), _to_device(kwargs, self.device)
        if torch.is_grad_enabled():
            self._begin_round()
        self._mirror()
        with self._explained():
            self._check_phase(_FORWARD)
            ahead = self._pull_ahead(args, kwargs)
            try:
                with self.phases.phase("forward"):
                    if not self._whole_pulls:
                        output = self.module(*args, **kwargs)
                    else:
                        # ps/optps: dense parameters too come from the servers, whole, each step
                        pulled = {name: table.lookup(rows)[0].view(shape)
                                  for name, (table, rows, shape) in self._whole_pulls.items()}
                        output = torch.func.functional_call(self.module, pulled, args, kwargs)
                if self.checks_phases and torch.is_grad_enabled():
                    self._time_users_backward(output)
                return output
            finally:
                for table in ahead:
                    table.prefetched = None

    def _time_users_backward(self, output: Any) -> None:
        """The own loop's ``loss.backward()`` (`parallax.distribute`) is the user's call: time
        it as the step's backward phase from the first gradient that reaches the model's
        outputs to the end of the backward (autograd's queued callback, as DDP's own)."""
        clock = self.phases
        tensors = [t for t in torch.utils._pytree.tree_leaves(output)
                   if isinstance(t, Tensor) and t.requires_grad]

        def started(_grad: Tensor) -> None:
            if clock.thread == threading.get_ident() and clock.open("backward"):
                torch.autograd.Variable._execution_engine.queue_callback(
                    lambda: clock.close("backward"))

        for tensor in tensors:
            tensor.register_hook(started)

    def _pull_ahead(self, args: tuple, kwargs: dict) -> list[ShardedTable]:
        """Pull, in one exchange, the rows of every server-held table this forward will read
        (all of a ps model's dense parameters; sparse lookups whose ids the id program
        computes from the inputs). Returns the tables served from the pulled rows."""
        wanted: dict[str, tuple[ShardedTable, list[Tensor]]] = {}
        if self._id_program is not None:
            with self.phases.phase("id look-ahead"):
                for path, ids in self._id_program(*args, **kwargs):
                    table = self._executed.get_submodule(path).table
                    if table.on_servers:  # replicated tables look up locally
                        wanted.setdefault(table.name, (table, []))[1].append(ids)
        for name, (table, rows, _) in self._whole_pulls.items():
            wanted[name] = (table, [rows])
        if wanted:
            tables = [table for table, _ in wanted.values()]
            fetch = AsyncTable.prefetch_together if self.asynchronous is not None else prefetch
            fetch(tables, [ids for _, ids in wanted.values()])
        return [table for table, _ in wanted.values()]

    def step(self, batch: Sequence[Any]) -> Tensor:
        """One synchronous training step on this worker's ``(inputs, targets)``; returns this
        worker's loss (detached)."""
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise ArgumentTypeError(f"rank {self.worker.rank}: Runner.step expects a batch "
                            f"(inputs, targets), got {type(batch).__name__}")
        inputs, targets = batch
        if self._batch_signature is None:
            self._batch_signature = _shapes(batch)
        with self._explained():
            self.zero_grad()
            with self.parallelism.counting():
                output = self.forward(inputs)
                with self.phases.phase("forward"):  # the loss function's share
                    loss = self.loss_fn(output, _to_device(targets, self.device))
                if self.progress is not None:
                    with self.phases.phase("progress record"):
                        self.progress.phase(self.global_step + 1, "backward")
                if self._early is not None:
                    self._early.arm([t for t in self.layout.all_tables().values()
                                     if t.on_servers])
                with self.phases.phase("backward"):
                    loss.backward()
            self._step_loss = float(loss.detach())
            self._step_targets = float(_numel(targets) * self.worker.world_size)
            self.apply_update(self.optimizers, loss=loss)
        return loss.detach()

    def sync_gradients(self, loss: Tensor | None = None, *, scaled: bool = False) -> bool:
        """Push this step's gradient rows to the servers, check finiteness on every rank
        (``loss`` too when given) and clip by `Config.clip_grad_norm`; once per step, later
        calls return the first one's answer. Returns whether the step's update applies
        (False: `Config.nonfinite` skipped it). Collective. ``scaled`` (a loss scaler's
        gradients): push only; the scaler checks and decides."""
        if not self._in_round:
            raise UnsupportedProgramError(
                f"rank {self.worker.rank}: a gradient update with no forward through the "
                f"distributed model since the last step (step {self.global_step + 1}); "
                f"gradients of a parallax model come from its forward: call the model that "
                f"parallax.distribute returned, then backward, then optimizer.step()")
        if self._synced:
            return self._applies
        if scaled and self.asynchronous is not None:
            raise UnsupportedProgramError(
                f"rank {self.worker.rank}: a loss scaler (parallax.GradScaler) under sync="
                f"{str(self.config.sync)!r}: its overflow check needs every worker's scaled "
                f"gradient of the same step; asynchronous servers apply each push on its own")
        if scaled and self.config.clip_grad_norm is not None:
            raise UnsupportedProgramError(
                "Config.clip_grad_norm would clip the loss scaler's scaled gradients: clip "
                "with parallax.clip_grad_norm_ after scaler.unscale_(optimizer) instead")
        self._check_no_gradient_outside_lookups()
        if self.asynchronous is not None:
            with self._explained():
                self._check_phase(_UPDATE)
                self._applies = self._push_asynchronously(loss)
                self._synced = True
            return self._applies
        with self._explained():
            self._check_phase(_UPDATE)
            with self.phases.phase("push"):
                if self._early is not None:
                    self._early.flush()  # what Runner.step's backward did not push yet
                push_all(self.layout.all_tables().values())
            with self.phases.phase("dense sync"):
                self.parallelism.reduce_gradients()  # "model"/"2d": over the data groups
            with self.phases.phase("clip and check"):
                if scaled:  # the scaler checks finiteness; which tables have gradients
                    self._agree_on_gradients(None)
                self._applies = True if scaled else self._finite_or_skip(loss)
                self._synced = True
                if self._applies and self.config.clip_grad_norm is not None:
                    self.last_grad_norm = self.clip_grad_norm(self.config.clip_grad_norm)
        return self._applies

    def unscale_tables(self, optimizers: Sequence[torch.optim.Optimizer],
                       inv_scale: Tensor) -> bool:
        """For `parallax.GradScaler`, after the push: multiply the aggregated rows of the
        tables ``optimizers`` update by ``inv_scale``; returns whether any of them is NaN or
        infinite (collective: the same answer on every rank)."""
        squared = torch.zeros((), dtype=torch.float64, device=self.device)
        for table in self._tables_of(optimizers):
            table.scale_grad(inv_scale)
            squared += table.grad_norm_squared()
        with self._explained():
            dist.all_reduce(squared, group=self.group)
        return not bool(torch.isfinite(squared))

    def _tables_of(self, optimizers: Sequence[torch.optim.Optimizer]) -> list[Table]:
        """The tables whose parameters ``optimizers`` hold."""
        mine = parameter_ids(optimizers)
        params = self._params
        return [t for name, t in self.layout.all_tables().items() if id(params[name]) in mine]

    def apply_update(self, optimizers: Sequence[torch.optim.Optimizer], *,
                     loss: Tensor | None = None) -> None:
        """Each of ``optimizers``' update: its replicated parameters here, its server-held
        rows on their servers (after `sync_gradients`). Collective."""
        if self.sync_gradients(loss):
            with self._explained():
                with self.phases.phase("dense update"), handles.internal():
                    for optimizer in optimizers:
                        dense_step = getattr(optimizer, "parallax_dense_step", None)
                        (dense_step or optimizer.step)()
                if self.asynchronous is None:  # asynchronous servers apply each push
                    with self.phases.phase("server update"):
                        self.shard_optimizer.step(optimizers)
        self.skip_update(optimizers)

    def skip_update(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """``optimizers`` are done with this step (updated, or skipped by a loss scaler that
        found an overflow); the step ends once every optimizer is."""
        self._stepped.update(id(optimizer) for optimizer in optimizers)
        if self._stepped >= {id(optimizer) for optimizer in self.optimizers}:
            self._end_round()

    def clip_grad_norm(self, max_norm: float, parameters: Iterable[nn.Parameter] | None = None,
                       ) -> float:
        """Clip the aggregated gradients of ``parameters`` (default: all) by their global L2
        norm, as ``clip_grad_norm_`` does on one device; returns the norm. Collective."""
        if self.asynchronous is not None:
            raise UnsupportedProgramError(
                f"rank {self.worker.rank}: clipping by the global norm of the aggregated "
                f"gradients under sync={str(self.config.sync)!r}: the servers apply each "
                f"worker's push on its own; Config(clip_grad_norm=...) clips each push "
                f"(sync='async')")
        if self.server_sync is not None:
            raise UnsupportedProgramError(
                f"rank {self.worker.rank}: clipping by the global norm of the aggregated "
                f"gradients under dense_sync={str(self.config.dense_sync)!r}: each worker "
                f"updates its own dense copy from its own gradients, there is no aggregated "
                f"dense gradient; use dense_sync='hierarchical' or 'qsgd' to clip")
        self.sync_gradients()
        wanted = None if parameters is None else {id(p) for p in parameters}
        params = self._params
        tables = [t for name, t in self.layout.all_tables().items()
                  if wanted is None or id(params[name]) in wanted]
        grads = [p.grad for p in self.replicated_parameters
                 if p.grad is not None and (wanted is None or id(p) in wanted)]
        everything = wanted is None or len(tables) == len(self.layout.all_tables())
        parts = self.parallelism.norm_parts()  # split parameters' shards, like tables
        chosen = [part for part in parts.values() if wanted is None or id(part.param) in wanted]
        everything = everything and len(chosen) == len(parts)
        tables = [*tables, *chosen]
        with self._explained():
            return clip_by_global_norm(
                max_norm, grads, tables,
                tables_squared=self._tables_squared if everything else None,
                group=self.group, device=self.device)

    def _check_phase(self, phase: int) -> None:
        """In the user's own loop (`parallax.distribute`), every rank must call forwards and
        optimizer steps in the same order: one small collective says where every rank is, so
        a rank that skipped ``optimizer.step()`` (or ran one forward more) is named on every
        rank instead of meeting a different collective. `step` needs no check (its order is
        fixed)."""
        if not self.checks_phases or self.worker.world_size == 1 or self.asynchronous:
            return  # (asynchronous workers are not in the same step: nothing to compare)
        mine = torch.tensor([phase, self.global_step + 1], dtype=torch.long, device=self.device)
        everyone = [torch.empty_like(mine) for _ in range(self.worker.world_size)]
        dist.all_gather(everyone, mine, group=self.group)
        where = [(int(t[0]), int(t[1])) for t in everyone]
        if len(set(where)) == 1:
            return
        said = {_FORWARD: "a forward of the model", _UPDATE: "optimizer.step()",
                _EXPORT: "model.state_dict()"}
        odd = [r for r, w in enumerate(where) if w != where[0]]
        raise UnsupportedProgramError(
            f"rank {self.worker.rank}: the ranks' training loops diverged: rank 0 called "
            f"{said[where[0][0]]} in step {where[0][1]}, "
            + ", ".join(f"rank {r} {said[where[r][0]]} in step {where[r][1]}" for r in odd)
            + ". Every rank must call the model and optimizer.step() in the same order (no "
            "rank may skip a step or run an extra forward)."
            + (f" {_COLLECTIVE_EXPORT}" if _EXPORT in {w[0] for w in where} else ""))

    def _check_no_gradient_outside_lookups(self) -> None:
        """A server-held parameter gets its gradient through its lookups only; one that the
        program read directly (a loss term on the whole table, under ps a dense weight used
        outside the model's forward) has a gradient nobody would push: refused."""
        params = self._params
        used = [name for name, table in self.layout.all_tables().items()
                if table.on_servers and params[name].grad is not None]
        if used:
            raise UnsupportedProgramError(
                f"rank {self.worker.rank}: parameter(s) {used} live on the parameter servers, "
                f"but the program computed a gradient for them outside the model's lookups "
                f"(e.g. a loss term on the whole weight); their values here are not the "
                f"servers' and that gradient would be lost. Compute such terms from the "
                f"model's outputs, or use architecture='allreduce' for these parameters.")

    def _begin_round(self) -> None:
        if self._stepped:  # some optimizers stepped, and a new step's forward comes
            self._end_round()
        if not self._in_round:
            self._in_round = True
            self._round_began = time.perf_counter()
            self.phases.begin(self.global_step + 1)
            if self.progress is not None:
                with self.phases.phase("progress record"):
                    self.progress.begin(self.global_step + 1)
            if self.asynchronous is not None:  # the staleness bound's wait
                self.asynchronous.before_step(self.global_step + 1)
        self._synced = False

    def _end_round(self) -> None:
        """After a step's updates: the dense servers' round (`Config.dense_sync` "plump" or
        "slim"), counters, progress, the warm-up's plan, the partition search and
        checkpoints."""
        if (self.server_sync is not None
                and (self.global_step + 1) % self.config.slim.sync_every == 0):
            with self._explained(), self.phases.phase("dense sync"):
                self.server_sync.communicate()
        if self.progress is not None:
            with self.phases.phase("progress record"):
                self.progress.done(self.global_step + 1)
        self._in_round = self._synced = False
        self._stepped.clear()
        self.traffic.steps += 1
        self._steps += 1
        self.global_step += 1
        if self.asynchronous is not None:
            self.asynchronous.after_step()
        elapsed = time.perf_counter() - self._round_began
        if self._tuner is not None and self._tuner.active:
            self._tuner.after_step(elapsed)
            if not self._tuner.active:
                self._build_plan()
                self._exit_if_plan_only()
        if self._steps == self._warmup_steps:
            self._complete_plan()
        elif self._warmup_steps == 0 and self._steps == 1:
            self._start_search()
        if self._checkpoint_due():
            with self.phases.phase("checkpoint"):
                self.save()
        self.phases.end()
        self._record_metrics()
        if self.verify_recorder is not None:
            self.verify_recorder.after_step()

    def _record_metrics(self) -> None:
        """The step into the headline's and the metrics' windows; rank 0 writes every
        `Config.log_every_steps` steps."""
        loss, targets = self._step_loss, self._step_targets
        self._step_loss = self._step_targets = None
        self._headline.add(loss, targets)
        self.metrics.window.add(loss, targets)
        self._last_targets = targets if targets is not None else self._last_targets
        if self.metrics.due(self.global_step):
            numbers = self._take(self.metrics.window, "metrics")
            self.metrics.write(self.global_step, numbers, self.plan,
                               str(self.config.architecture))

    def _take(self, window: Window, name: str) -> dict[str, Any]:
        """``window``'s numbers. Asynchronous workers are not in step: their target elements
        are what all of them finished since the window began (rank 0's batch size each)."""
        targets = None
        if self.asynchronous is not None and self._last_targets is not None:
            done = self.asynchronous.global_steps()
            targets = ((done - self._global_steps_at[name]) * self._last_targets
                       / self.worker.world_size)
            self._global_steps_at[name] = done
        seconds = {name: self.phases.seconds.get(name, 0.0) for name in (*PHASES, "step")}
        numbers = window.take(self._bytes_so_far(), seconds, targets=targets)
        step = numbers["phases"].pop("step")
        numbers["phases"]["other"] = max(0.0, step - sum(numbers["phases"].values()))
        numbers["phases"]["step"] = step
        return numbers

    def _bytes_so_far(self) -> dict[str, float]:
        """Bytes this rank sent and received per parameter since the start or reset_stats."""
        return {name: float(sum(counts.values())) for name, counts in self.traffic.bytes.items()}

    def headline(self) -> dict[str, float | None]:
        """The numbers for a progress bar, over the steps since the last call: ``loss``
        (this rank's, `Runner.step` only), ``targets_per_s`` (every worker's target elements
        per second: words of an LM, samples of a classifier), ``bytes_per_step`` (what this
        rank sent and received) and ``step_s``. Not collective."""
        numbers = self._take(self._headline, "headline")
        return {"loss": numbers["loss"], "targets_per_s": numbers["targets_per_s"],
                "bytes_per_step": sum(numbers["bytes"].values()),
                "step_s": numbers["phases"].get("step", 0.0)}

    @contextlib.contextmanager
    def _explained(self) -> Iterator[None]:
        """A failed collective raised inside names the rank that is missing (outermost only)."""
        self._explaining += 1
        try:
            yield
        except (RuntimeError, ValueError) as error:  # gloo's are RuntimeErrors
            if self._explaining > 1 or self.progress is None or not is_collective_failure(error):
                raise
            explained = self.progress.explain(error, self.global_step + 1)
            if explained is error:
                raise
            raise explained from error
        finally:
            self._explaining -= 1

    def evaluate(self, batches: Iterable[Sequence[Any]]) -> float:
        """Mean loss over the batches of *all* workers (each worker passes its own shard, e.g.
        a `parallax.shard`-ed validation loader), weighted by batch size. Collective: every
        worker must pass the same number of batches."""
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        with torch.no_grad(), self._serving_global(), _evaluating(self.model, self.module):
            for inputs, targets in batches:
                targets = _to_device(targets, self.device)
                loss = self.loss_fn(self.forward(inputs), targets)
                count = len(targets)
                total += torch.tensor([float(loss) * count, count], dtype=torch.float64,
                                      device=self.device)
        dist.all_reduce(total, group=self.group)
        return float(total[0] / total[1].clamp_min(1))

    def zero_grad(self, optimizers: Sequence[torch.optim.Optimizer] | None = None, *,
                  set_to_none: bool = True) -> None:
        """Clear the gradients of every parameter, or of those ``optimizers`` update (their
        replicated parameters here, their tables' rows on the servers), as
        ``Optimizer.zero_grad(set_to_none)`` does on one device. Gradients of forwards not
        yet backpropagated are kept, as on one device."""
        mine = None if optimizers is None else parameter_ids(optimizers)
        for param in [*self.replicated_parameters, *self._split_parameters]:
            if mine is None or id(param) in mine:
                _clear_grad(param, set_to_none)
        tables = (list(self.layout.all_tables().values()) if optimizers is None
                  else self._tables_of(optimizers))
        for table in tables:
            table.zero_grad(set_to_none=set_to_none)

    def _server_held(self) -> list[ShardedTable]:
        return [t for t in self.layout.all_tables().values() if isinstance(t, ShardedTable)]

    def _gradient_flags(self) -> Tensor:
        """Whether a backward reached each `_server_held` table on this worker
        (`ShardedTable.has_gradient`), as 1.0 or 0.0."""
        return torch.tensor([float(t.has_gradient) for t in self._server_held()],
                            dtype=torch.float64, device=self.device)

    def _agree_on_gradients(self, summed: Tensor | None) -> None:
        """Tell each server-held table whether any worker's backward reached it
        (``summed``: `_gradient_flags` summed over the ranks; None: sum them now,
        collective)."""
        tables = self._server_held()
        if not tables:
            return
        if summed is None:
            summed = self._gradient_flags()
            dist.all_reduce(summed, group=self.group)
        for table, count in zip(tables, summed.tolist(), strict=True):
            table.gradient_anywhere = count > 0

    def _finite_or_skip(self, loss: Tensor | None) -> bool:
        """Whether to apply this step's update under `Config.nonfinite`; all workers decide
        alike before anything is updated (`parallax.engine.grad_norm.find_nonfinite`)."""
        self._tables_squared = None
        if self.config.nonfinite == "ignore":
            self._agree_on_gradients(None)
            return True
        found = find_nonfinite(loss, {**self.layout.all_tables(),
                                      **self.parallelism.norm_parts()},
                               [(n, p.grad) for n, p in self._replicated_named_parameters()],
                               rank=self.worker.rank, world=self.worker.world_size,
                               group=self.group, device=self.device,
                               flags=self._gradient_flags())
        self._agree_on_gradients(found.flags)
        self._tables_squared = found.tables_squared
        if not found:
            return True
        if self.config.nonfinite == "raise":
            raise NonFiniteError(
                f"rank {self.worker.rank}, step {self.global_step + 1}: NaN or infinite "
                f"{found.describe()}; no parameter was updated. Config(nonfinite='skip') skips "
                f"such steps.")
        self.skipped_steps += 1
        if self.worker.rank == 0:
            log.warning("parallax: step %d skipped (NaN or infinite %s)", self.global_step + 1,
                        found.describe())
        self.zero_grad()
        return False

    def _push_asynchronously(self, loss: Tensor | None) -> bool:
        """`sync_gradients` under an asynchronous `Config.sync`: this worker's own checks,
        then its push (returns once every server applied it). Returns whether the dense
        update applies. The non-finite check needs no collective: the dense gradient is the
        same on every worker (AllReduced, or none under "async"), the pushed rows are this
        worker's own, so a bad push is dropped (or raised) here alone."""
        tables = [t for t in self.layout.all_tables().values() if isinstance(t, AsyncTable)]
        with self.phases.phase("clip and check"):
            dense_ok = self._check_and_clip_push(loss, tables)
        with self.phases.phase("push"):
            AsyncTable.push_together(tables)
        return dense_ok

    def _check_and_clip_push(self, loss: Tensor | None, tables: list[AsyncTable]) -> bool:
        """`Config.nonfinite` and `Config.clip_grad_norm` on this worker's own push."""
        run = self.asynchronous
        dense_ok = True
        if self.config.nonfinite != "ignore":
            bad_dense = [n for n, p in self._replicated_named_parameters()
                         if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
            bad_own = [t.name for t in tables if t.own_nonfinite()]
            if loss is not None and not bool(torch.isfinite(loss.detach()).all()):
                bad_own.insert(0, "loss")
            if bad_dense or bad_own:
                what = ", ".join(bad_own + bad_dense)
                if self.config.nonfinite == "raise":
                    raise NonFiniteError(
                        f"rank {self.worker.rank}, step {self.global_step + 1}: NaN or "
                        f"infinite {what}; this worker pushed nothing. "
                        f"Config(nonfinite='skip') drops such pushes.")
                self.skipped_steps += 1
                log.warning("parallax: rank %d, step %d: push dropped (NaN or infinite %s)",
                            self.worker.rank, self.global_step + 1, what)
                run.skip_push = True
                dense_ok = not bad_dense
        if self.config.clip_grad_norm is not None and not run.skip_push:
            # this worker's own push (its tables' norms are its own: no collective)
            own = sum((t.grad_norm_squared() for t in tables),
                      torch.zeros((), dtype=torch.float64))
            self.last_grad_norm = clip_by_global_norm(
                self.config.clip_grad_norm, [], tables, tables_squared=own, group=self.group,
                device=self.device)
        return dense_ok

    def _check_async_program(self) -> None:
        """Refuse what asynchronous servers cannot do as one device would."""
        for name, use in self.sparse_uses.items():
            if use.batch_dependent is not None:
                raise UnsupportedProgramError(
                    f"parameter '{name}' is looked up with max_norm or scale_grad_by_freq, "
                    f"whose result depends on every worker's ids of the same step; under "
                    f"sync={str(self.config.sync)!r} the workers' steps are not aligned. Use "
                    f"sync='sync' for this model, or drop the option.")

    def _quiet(self) -> contextlib.AbstractContextManager[None]:
        """Under asynchronous training, no request in flight while inside (every push
        applied: a consistent snapshot of the shards; collective); otherwise nothing."""
        if self.asynchronous is None:
            return contextlib.nullcontext()
        return self.asynchronous.quiet(self.group)

    def _replicated_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        ids = {id(p) for p in self.replicated_parameters}
        return [(n, p) for n, p in self.model.named_parameters() if id(p) in ids]

    def repartition(self, num_partitions: int, names: Iterable[str] | None = None) -> None:
        """Split the server-held sparse tables (all, or those in ``names``) into
        ``num_partitions`` partitions each, keeping their values and optimizer state; training
        continues exactly as before (collective)."""
        if self.asynchronous is not None:
            raise UnsupportedProgramError(
                f"rank {self.worker.rank}: re-partitioning under sync="
                f"{str(self.config.sync)!r} is not implemented (the servers' threads hold the "
                f"partitions); set Config.num_partitions before training")
        wanted = None if names is None else set(names)
        for name, table in self.tables.items():
            if not table.on_servers or (wanted is not None and name not in wanted):
                continue
            if table.partitioning.num_partitions == num_partitions:
                continue
            repartition(table, num_partitions, self.shard_optimizer)
            sync, _, servers = self.layout.placements[name]
            self.layout.placements[name] = (sync, num_partitions, servers)
        self._build_plan()

    @property
    def partition_searches(self) -> dict[str, SearchRecord]:
        """Per partition group (`parallax.partitioner`), how its count was chosen (empty
        until the search, which starts after the warm-up steps, has finished a group)."""
        return {} if self._tuner is None else dict(self._tuner.records)

    # ---- partition search ----------------------------------------------------------------
    def _build_tuner(self) -> PartitionTuner | None:
        if self.asynchronous is not None:  # its timed samples need aligned steps
            return None
        return build_tuner(self.model, self.tables, config=self.config, worker=self.worker,
                           local_aggregation=self.architecture.aggregates_locally(self.config),
                           threads=self.pool.threads, group=self.group, device=self.device,
                           repartition=lambda count, names: self.repartition(count, names))

    def _start_search(self) -> None:
        if self._tuner is None:
            return
        self._tuner.groups_on_servers({name for name, table in self.tables.items()
                                       if table.on_servers})
        self._tuner.begin(self._batch_signature)
        self._build_plan()

    # ---- checkpoints -------------------------------------------------------------------------
    def save(self, path: str | os.PathLike | None = None, *, extra: Any = None) -> Path:
        """Write a sharded checkpoint of this step under ``path`` (default
        `Config.checkpoint_dir`): servers write their rows and optimizer state, rank 0 the
        dense part, the positions of the `parallax.shard` loaders and ``extra`` (anything
        ``torch.save`` takes, e.g. an lr scheduler's state). Collective; returns the step
        directory."""
        root = path if path is not None else self.config.checkpoint_dir
        if root is None:
            raise ArgumentError("Runner.save needs a path, or Config(checkpoint_dir=...)")
        if self.server_sync is not None:
            raise UnsupportedProgramError(
                f"rank {self.worker.rank}: checkpoints under dense_sync="
                f"{str(self.config.dense_sync)!r} are not implemented (the servers' dense model "
                f"and each worker's pending update would have to be saved); Runner.export "
                f"writes the trained model")
        keep = self.config.checkpoint_keep if path is None else None
        with self._quiet():
            directory = checkpoint.save(self, root, keep=keep, extra=extra)
        self._last_save = time.monotonic()
        return directory

    def load(self, path: str | os.PathLike | None = None) -> Any:
        """Restore the checkpoint at ``path`` (a step directory), or the newest complete one
        under it (default `Config.checkpoint_dir`), on this cluster whatever its shape and
        partition counts were: parameters, optimizer state, step, loader positions (and
        random generators when the worker count is the same). Returns the saved ``extra``.
        Collective."""
        root = path if path is not None else self.config.checkpoint_dir
        if root is None:
            raise ArgumentError("Runner.load needs a path, or Config(checkpoint_dir=...)")
        with self._quiet():
            extra = checkpoint.load(self, root)
        if self.asynchronous is not None:
            self.asynchronous.gate.start(self.global_step)
        return extra

    def _resume_from_newest(self, root: str) -> None:
        found = checkpoint.find(root) is not None if self.worker.rank == 0 else None
        if agree(found, rank=self.worker.rank, group=self.group):
            self.load(root)
            if self.worker.rank == 0:
                print(f"parallax: resumed from step {self.global_step} ({root})",
                      file=sys.stderr, flush=True)

    def _checkpoint_due(self) -> bool:
        config = self.config
        if config.checkpoint_every_steps and self.global_step % config.checkpoint_every_steps == 0:
            return True
        if config.checkpoint_every_secs is None:
            return False
        due = torch.tensor(float(time.monotonic() - self._last_save
                                 >= config.checkpoint_every_secs), device=self.device)
        dist.broadcast(due, src=0, group=self.group)  # rank 0's clock decides
        return bool(due)

    # ---- plan ----------------------------------------------------------------------------
    def _build_plan(self) -> None:
        self.plan = Plan.build(self.model, self.sparse_uses, placements=self.layout.placements,
                               world_size=self.worker.world_size,
                               num_machines=len(self.worker.server_ranks),
                               architecture=self.config.architecture, sparsity=self.sparsity,
                               reasons=self._decisions,
                               local_aggregation=self.local_aggregation,
                               searches=tuple(self.partition_searches.values()))

    def _complete_plan(self) -> None:
        """After the warm-up steps: measure α; move to AllReduce what the architecture says
        is cheaper there (the hybrid's rule: `Architecture.moves_to_allreduce`; collective)."""
        self.sparsity = measure(self.tables, self.worker, self.group, self.device)
        self._decide_local_aggregation()
        if self._early is not None:
            self._early.learn(self.group)
        params = self._params
        for name, table in list(self.tables.items()):
            move, why = self.architecture.moves_to_allreduce(
                table, self.sparsity[name], config=self.config, worker=self.worker)
            if move and self.asynchronous is not None:
                self._decisions[name] = (f"stays on the servers (sync="
                                         f"{str(self.config.sync)!r}); {why}")
                move = False
            if not move:
                continue
            self._replace_table(table, move_to_allreduce(
                table, params[name], self.optimizers, self.shard_optimizer,
                worker=self.worker, group=self.group))
            self.replicated_parameters.append(params[name])
            self._decisions[name] = why
        self._start_search()
        self._build_plan()
        self._exit_if_plan_only()

    def _decide_local_aggregation(self) -> None:
        """Keep or drop the leader hop as the architecture says for the measured α and α_m
        (the same answer on every rank: both are all-reduced)."""
        if not self.local_aggregation:
            return
        keep, why = self.architecture.keeps_local_aggregation(
            self.tables, self.sparsity, config=self.config, worker=self.worker)
        self.local_aggregation = keep
        for name, table in self.layout.all_tables().items():
            if table.on_servers:
                table.local_aggregation = table.local_aggregation and keep
                if name in self.sparse_uses and why:
                    self._decisions[name] = why

    def _exit_if_plan_only(self) -> None:
        """Under ``parallax plan``, stop once α is measured and any search is done."""
        plan_only = os.environ.get(PLAN_ONLY_ENV)
        if plan_only is not None and not (self._tuner is not None and self._tuner.active):
            self._print_plan_and_exit(plan_only)

    def _replace_table(self, old: Table, new: Table) -> None:
        self.tables[old.name] = new
        self.layout.placements[old.name] = (
            "allreduce" if new.sync == "allreduce" else "allgatherv", 0, ())
        for module in self.module.modules():
            if getattr(module, "table", None) is old:
                module.table = new

    def _print_plan_and_exit(self, path: str) -> None:
        """``parallax plan``: the workers ran only the warm-up steps to measure α. The plan is
        printed and written, then `PlanComplete` (a `SystemExit` with status 0) ends the
        program."""
        if self.worker.rank == 0:
            print("\n" + self.plan.table(), flush=True)  # below any progress bar
            if self.parallelism.grid.model > 1:
                print(self.parallelism.describe(), flush=True)
            if path:
                Path(path).write_text(self.plan.to_json())
        dist.barrier(group=self.group)
        shutdown()
        raise PlanComplete(path or "the plan is printed")

    # ---- export --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Tensor]:
        """A plain single-device ``state_dict`` of the original model class (collective: on
        every rank, not only on the one that saves it)."""
        with self._quiet():
            return self._state_dict()

    def _state_dict(self) -> dict[str, Tensor]:
        try:
            with self._explained():
                self._check_phase(_EXPORT)
        except UnevenInputsError as error:  # the other ranks ended: this rank exports alone
            raise UnevenInputsError(
                f"rank {self.worker.rank} called model.state_dict() after another rank ended "
                f"({error}). {_COLLECTIVE_EXPORT}") from error
        with self._serving_global():
            state = self.parallelism.plain_model_state(self.model.state_dict())
            if self.server_sync is not None:  # the parameters get this worker's values back
                state = {k: v.clone() for k, v in state.items()}
        names_of: dict[int, list[str]] = {}  # tied parameters appear under every name
        for name, param in self.model.named_parameters(remove_duplicate=False):
            names_of.setdefault(id(param), []).append(name)
        params = self._params
        for name, table in self.layout.all_tables().items():
            full = table.full_weight().view(state[name].shape).to(self.device)
            for alias in names_of[id(params[name])]:
                state[alias] = full
        return state

    def export(self, path: str | os.PathLike) -> Path | None:
        """Write the plain single-device ``state_dict`` to ``path`` on rank 0 (collective),
        streamed: each server-held table comes from its servers in chunks of rows written
        straight into the file (`parallax.checkpoint.streamed`), so no process ever holds a
        whole table in memory (`state_dict` gathers each one whole on every rank). Returns
        ``path`` on rank 0, None elsewhere; ``torch.load(path, mmap=True)`` reads it the same
        way."""
        with self._explained():
            self._check_phase(_EXPORT)
        held = {name: t for name, t in self.layout.all_tables().items() if t.on_servers}
        aliases = self._server_held_aliases()
        names = {name: aliases[id(self._params[name])] for name in held}
        with self._serving_global(), self._quiet():
            return export_running(path,
                                  self.parallelism.plain_model_state(self.model.state_dict()),
                                  held, names,
                                  rank=self.worker.rank)

    def _serving_global(self) -> contextlib.AbstractContextManager[None]:
        """Under `Config.dense_sync` "plump"/"slim", the servers' dense values in the model
        while inside (evaluation and export see what training produced, not this worker's
        copy; collective); otherwise nothing."""
        if self.server_sync is None:
            return contextlib.nullcontext()
        return self.server_sync.serving_global()

    def load_state_dict(self, state: dict[str, Tensor], *, strict: bool = True) -> Any:
        """Load a plain single-device ``state_dict`` of the original model class (every rank
        passes the same values): into the model, and the server-held rows onto their servers.
        Optimizer state is untouched, as on one device. Returns what
        ``nn.Module.load_state_dict`` returns."""
        with self._quiet():
            return self._load_state_dict(state, strict=strict)

    def _load_state_dict(self, state: dict[str, Tensor], *, strict: bool) -> Any:
        differs = first_difference(state, rank=self.worker.rank, world=self.worker.world_size,
                                   group=self.group)
        if differs is not None:  # the replicas would silently part ways
            other, key = differs
            raise UnsupportedProgramError(
                f"{handles.program_line()}: load_state_dict: rank {other} passed a different "
                f"{key!r} than rank 0 (or "
                f"only one of them has it); every rank must load the same values. A file "
                f"read while rank 0 was still writing it? Call torch.distributed.barrier() "
                f"after saving on rank 0, before other ranks read the file")
        aliases = self._server_held_aliases()
        held = {name for names in aliases.values() for name in names}
        state = self.parallelism.load_plain_model_state(state)  # the split layers' shards
        result = self.model.load_state_dict({k: v for k, v in state.items() if k not in held},
                                            strict=False)
        missing = [k for k in result.missing_keys
                   if k not in held and k not in self.parallelism.sharded]
        missing += sorted(k for k in held if k not in state)
        if strict and (missing or result.unexpected_keys):
            raise UsageError(
                f"Error(s) in loading state_dict for {type(self.model).__name__}: missing "
                f"keys {missing}, unexpected keys {result.unexpected_keys}")
        params = self._params
        for name, table in self.layout.all_tables().items():
            given = [alias for alias in aliases.get(id(params[name]), ()) if alias in state]
            if given:
                table.assign(state[given[0]].to(self.device))
        return result.__class__(missing, result.unexpected_keys)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """``optimizer.state_dict()`` as on one device (collective): the state of its
        server-held parameters is gathered from the servers, each per-row tensor whole on
        every rank (as `state_dict` gathers the tables; for tables larger than memory,
        checkpoint with `save`)."""
        with self._quiet():
            return self._optimizer_state_dict(optimizer)

    def _optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        state = self.parallelism.plain_optimizer_state(optimizer, local_state_dict(optimizer))
        state["state"] = dict(state["state"])
        index = _indices(optimizer)
        for name, table in self.layout.all_tables().items():
            param = self._params[name]
            if not table.on_servers or id(param) not in index:
                continue
            shard_state = (self.shard_optimizer.table_state(table)
                           if table.shard is not None else {})
            mine = {key: ("rows" if is_per_row(value, table.shard) else value)
                    for key, value in shard_state.items()}
            everyone: list[Any] = [None] * self.worker.world_size
            dist.all_gather_object(everyone, mine, group=self.group)
            kinds = next((kinds for kinds in everyone if kinds), {})  # a server's (all alike)
            entry = {}
            for key, kind in kinds.items():
                if isinstance(kind, str) and kind == "rows":
                    entry[key] = table.full_weight(shard_state.get(key)).view(param.shape)
                else:
                    entry[key] = kind
            if entry:
                state["state"][index[id(param)]] = entry
        return state

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """``optimizer.load_state_dict(state)`` of a single-device state dict (every rank
        passes the same): each server takes its rows of a server-held parameter's state,
        the optimizer object the rest."""
        with self._quiet():
            self._load_optimizer_state_dict(optimizer, state)

    def _load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer,
                                   state: dict) -> None:
        index = _indices(optimizer)
        kept = dict(state["state"])
        for name, table in self.layout.all_tables().items():
            param = self._params[name]
            if not table.on_servers or id(param) not in index:
                continue
            entry = kept.pop(index[id(param)], None) or {}
            if table.shard is None:
                continue
            self.shard_optimizer.set_table_state(table, {
                key: table.own_rows(value) if is_per_row(value, param) else value
                for key, value in entry.items()})
        local_load_state_dict(optimizer, {**state, "state": kept})
        self.parallelism.distribute_optimizer_state(optimizer)

    def _server_held_aliases(self) -> dict[int, tuple[str, ...]]:
        """Per server-held parameter (by id), every name it has in the state dict."""
        params = self._params
        ids = {id(params[name]) for name, t in self.layout.all_tables().items() if t.on_servers}
        aliases: dict[int, tuple[str, ...]] = {}
        for name, param in self.model.named_parameters(remove_duplicate=False):
            if id(param) in ids:
                aliases[id(param)] = (*aliases.get(id(param), ()), name)
        return aliases

    def predicted_memory(self) -> MemoryEstimate:
        """The bytes this rank holds for training by the memory model
        (`parallax.planning.memory`): what it keeps whole, its own shards, their gradients,
        optimizer state and the buffers."""
        return predict_memory(self._executed, self.layout.all_tables(), self._params,
                              self.optimizers,
                              uses_ddp=self.layout.uses_ddp and not self.parallelism.replaces_ddp,
                              pulled_whole=self.layout.pulled_whole)

    def stats(self) -> dict[str, dict[str, float]]:
        """Bytes this worker sent and received per training step through the parameter-server
        and AllGatherv exchanges, per parameter, split into intra- and inter-machine traffic;
        and under ``"step phases"`` the seconds per step of each phase of the step on this
        rank (`parallax.engine.phases.PHASES`, self times: they add up to ``"step"`` with
        ``"other"``, what no phase covers). Averaged over the steps since the start or the
        last ``reset_stats``."""
        return {**self.traffic.per_step(), STATS_KEY: self.phases.per_step()}

    def inter_machine_bytes(self) -> dict[str, float]:
        """Per parameter, the measured bytes (sent + received) crossing machines per machine
        and step, averaged over machines: what the plan's ``predicted_bytes`` predict
        (collective)."""
        names = [p.name for p in self.plan.parameters]
        per_step = self.traffic.per_step()
        values = torch.tensor(
            [per_step.get(n, {}).get("inter_sent", 0.0)
             + per_step.get(n, {}).get("inter_received", 0.0) for n in names],
            dtype=torch.float64, device=self.device)
        dist.all_reduce(values, group=self.group)
        values /= len(self.worker.server_ranks)
        return dict(zip(names, values.tolist(), strict=True))

    @property
    def dense_sync_seconds(self) -> float:
        """Seconds this worker spent synchronising dense parameters since the start or the
        last ``reset_stats``: inside the synchronous comm hooks (``hierarchical``, ``qsgd``:
        collectives, encoding, decoding) or the servers' rounds (``plump``, ``slim``: core
        selection and exploration too); 0 for ``flat`` (asynchronous: it overlaps the
        backward) and for a model with no replicated dense parameter."""
        if self.server_sync is not None:
            return self.server_sync.seconds
        return self._hook_state.seconds if self._hook_state is not None else 0.0

    def reset_stats(self) -> None:
        """Restart the byte counts of `stats` and `dense_sync_seconds`."""
        self.traffic.reset()
        self.phases.reset()
        self.parallelism.reset()
        if self.server_sync is not None:
            self.server_sync.seconds = 0.0
        if self._hook_state is not None:
            self._hook_state.seconds = 0.0


@contextlib.contextmanager
def _evaluating(*trees: nn.Module) -> Iterator[None]:
    """Every module of ``trees`` in eval mode inside (the user's tree too: `mirror` brings
    its flags to the copies that run); each module's own mode back after."""
    modes = [(module, module.training) for tree in trees for module in tree.modules()]
    for tree in trees:
        tree.eval()
    try:
        yield
    finally:
        for module, mode in modes:
            module.training = mode


def _held(table: Table) -> Table:
    """The table that holds a parameter's shard on the servers (an `AsyncTable`'s wrapped
    one: the servers' optimizer and state work on it)."""
    return table.inner if isinstance(table, AsyncTable) else table


def _clear_grad(param: Tensor, set_to_none: bool) -> None:
    """``Optimizer.zero_grad``'s clearing of one parameter's gradient."""
    if param.grad is None or set_to_none:
        param.grad = None
    elif param.grad.grad_fn is not None:
        param.grad.detach_().zero_()
    else:
        param.grad.requires_grad_(False).zero_()


def _indices(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """Parameter id -> its index in ``optimizer``'s state dicts (param groups in order)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {id(p): i for i, p in enumerate(params)}


def _numel(value: Any) -> int:
    """Target elements of a batch's targets (tensors anywhere inside)."""
    if isinstance(value, Tensor):
        return value.numel()
    if isinstance(value, dict):
        return sum(_numel(v) for v in value.values())
    if isinstance(value, (tuple, list)):
        return sum(_numel(v) for v in value)
    return 0


def _shapes(value: Any) -> Any:
    """The tensor shapes of a batch (what the search's cache entry is valid for)."""
    if isinstance(value, Tensor):
        return [list(value.shape), str(value.dtype)]
    if isinstance(value, dict):
        return {str(k): _shapes(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (tuple, list)):
        return [_shapes(v) for v in value]
    return type(value).__name__


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_to_device(v, device) for v in value)
    return value
