"""`Runner`: the coordinator of a run. It builds the parts (`parallax.step`) once, each behind
a small contract, and delegates to them; it never asks which mode a part is.

Step on worker r: forward (sparse lookups pull rows from the servers: the sync mode's
``prefetch``) -> loss -> backward (the dense sync's DDP hooks AllReduce the dense gradients)
-> the sync mode's ``push`` (gradient rows to their servers, which sum them over workers;
finiteness and `Config` clipping over the global gradient) -> dense update on every worker with
the user's optimizer -> the sync mode's ``update`` (the servers apply the same optimizer class
to their shards) -> the step hooks (plan, checkpoints, numbers).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import distributed_c10d

from parallax.checkpoint.single_device import SingleDeviceView
from parallax.cluster import LaunchOrders, WorkerInfo
from parallax.config import Config
from parallax.engine.asynchronous.async_training import AsyncTraining
from parallax.engine.dense_sync.server_sync import ServerSync
from parallax.engine.dense_sync.strategy import DenseSync, build_dense_sync
from parallax.engine.diagnostics.phases import PhaseClock
from parallax.engine.diagnostics.progress import Explainer, Progress
from parallax.engine.optimizers.shard_optimizer import (
    check_lazy,
    check_per_shard,
)
from parallax.engine.tables.after_aggregation import AFTER_AGGREGATION
from parallax.engine.tables.backward_push import BackwardPush
from parallax.engine.tables.exchange import Traffic
from parallax.engine.tables.handles import ServerGradient
from parallax.engine.tables.own import OwnTable
from parallax.engine.tables.pool import default_threads, shared_pool
from parallax.errors import ArgumentTypeError
from parallax.model.detect import SparseUse, find_sparse_parameters, tracing_once
from parallax.model.exactness import (
    PerWorkerMean,
    RequiresGradWatch,
    check_exact,
    check_not_compiled,
    warn_per_worker_statistics,
)
from parallax.model.loop_reads import layers_back, serve_layer_calls
from parallax.model.meta_init import place_on_device
from parallax.model.stand_ins import executed_copy, mirror
from parallax.parallelism import Parallelism, build_parallelism
from parallax.partitions.tuner import SearchRecord
from parallax.planning.architectures import architecture_of
from parallax.planning.memory import MemoryEstimate, predict_memory
from parallax.planning.plan import Plan
from parallax.planning.table_kinds import build_layout
from parallax.session import check_same_everywhere, on_shutdown, track
from parallax.step.checkpoints import Checkpoints
from parallax.step.forward import (
    Forward,
    ProgramForward,
    call_to_device,
    checked_loss,
    evaluating,
    mean_loss,
    numel,
    shapes,
    to_device,
)
from parallax.step.global_mean import global_mean
from parallax.step.gradients import StepGradients
from parallax.step.hooks import Reporting, StepHook
from parallax.step.loop_order import Call, LoopOrder
from parallax.step.nonfinite import NonFinitePolicy
from parallax.step.one_backward import watch_backwards
from parallax.step.plan_keeper import PlanKeeper
from parallax.step.round import StepRound
from parallax.step.servers import hand_over
from parallax.step.sync_modes import SyncMode, build_sync_mode
from parallax.step.torch_errors import TorchErrors, ddp_parameter_names

LossFn = Callable[[Any, Any], Tensor]


class Runner:
    """Trains ``model`` data-parallel; every public method is collective (call it on all ranks).

    The runner executes a structural copy of the user's ``model`` that shares its dense
    parameters and buffers, so the dense parameters the user holds are the ones being trained.
    A parameter the servers hold is released in the user's model (a storage-less handle on the
    ``meta`` device, `parallax.engine.tables.handles`): `state_dict` brings its values back.
    """

    def __init__(self, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer],
                 loss_fn: LossFn, *, worker: WorkerInfo, config: Config,
                 sparse_group: dist.ProcessGroup):
        self.model = model
        self.optimizers = list(optimizers)
        self.loss_fn = loss_fn
        self._per_worker_mean = PerWorkerMean(loss_fn, worker.world_size)
        self.worker = worker
        self.config = config
        self.device = worker.device
        self.group = sparse_group  # every rank of the run (checkpoints agree through it)
        check_same_everywhere(model, config, worker, sparse_group)
        orders = LaunchOrders.from_env()  # what the parallax command asked beyond training
        # Where every rank is, in the job's store: a failed collective names who is missing.
        #: the training run of this process the runner belongs to (its loaders, checkpoints'
        #: data positions; parallax.global_mean finds the run through it)
        self.training_run = track(self)
        self.progress = (Progress(worker.rank, worker.world_size, config.collective_timeout_s,
                                  run=self.training_run.number)
                         if worker.world_size > 1 else None)
        self._explained = Explainer(self.progress, lambda: self.global_step + 1)
        # DDP's errors (unused parameters, ...) named with the parallax fix
        self._torch_errors = TorchErrors(worker.rank, worker.device,
                                         lambda: self.global_step + 1,
                                         lambda: ddp_parameter_names(self.dense.module))
        # where each step's time goes (runner.stats()["step phases"]; parallax run --timeline)
        self.phases = PhaseClock(worker.rank, orders.timeline, world_size=worker.world_size,
                                 store=(distributed_c10d._get_default_store()
                                        if orders.timeline and worker.world_size > 1 else None))
        on_shutdown(self.phases.write)
        self.traffic = Traffic(worker.rank, worker.machine_of_rank)
        self._build_layout(model, orders)
        self._build_executed(model)
        self.pool = shared_pool(config.server_threads or default_threads())
        self.shard_optimizer = hand_over(self.layout.all_tables(), self._params, self.optimizers,
                                         self.pool, worker=worker,
                                         taken=self.layout.user_state)
        self._build_step()
        self.checkpoints.resume_from_newest()
        self.sync_mode.start(self.shard_optimizer, self.global_step, self.progress)
        self.reporting.start()

    # ---- construction ------------------------------------------------------------------------
    def _build_layout(self, model: nn.Module, orders: LaunchOrders) -> None:
        """Where each parameter lives (`parallax.planning`), the sync mode over it, and the
        plan's keeper."""
        config = self.config
        with tracing_once(model):  # both read the model's trace: one trace
            self.sparse_uses: dict[str, SparseUse] = find_sparse_parameters(model)
            check_exact(model, self.sparse_uses, config)
        self.architecture = architecture_of(config)
        server_held = self.architecture.server_held(model, self.sparse_uses)
        check_not_compiled(model, [*self.sparse_uses, *server_held], self.worker.rank)
        if self.worker.rank == 0:
            warn_per_worker_statistics(model, self.worker.world_size)
        place_on_device(model, server_held, self.optimizers, self.device)
        self._params = dict(model.named_parameters())  # the objects never change
        self._requires_grad = RequiresGradWatch(self._params, self.worker.rank)
        self.layout = build_layout(model, self.sparse_uses, config=config, worker=self.worker,
                                   group=self.group, traffic=self.traffic,
                                   optimizers=self.optimizers)
        self.nonfinite = NonFinitePolicy(config.nonfinite, self.worker.rank)
        # before anything reads the tables: a sync mode may wrap the server-held ones
        self.sync_mode: SyncMode = build_sync_mode(
            config, self.worker, self.phases, self.nonfinite, self.layout,
            sparse_uses=self.sparse_uses, traffic=self.traffic)
        self.tables = self.layout.sparse
        self.backward_push = BackwardPush(self.layout.replicas, self.layout.summed_own)
        check_per_shard(self.optimizers, server_held)
        if config.lazy_sparse_updates:
            check_lazy(self.optimizers, {n: self._params[n] for n in self.sparse_uses})
        warmup = (orders.warmup_steps if orders.warmup_steps is not None
                  else config.sparsity_warmup_steps)
        self.planner = PlanKeeper(model, self.sparse_uses, self.layout,
                                  architecture=self.architecture, config=config,
                                  worker=self.worker, group=self.group, sync_mode=self.sync_mode,
                                  warmup_steps=self.sync_mode.warmup_steps(warmup),
                                  plan_only=orders.plan_only)
        self.planner.program_sees_grads = lambda: self.order.enabled

    def _build_executed(self, model: nn.Module) -> None:
        """The module tree that runs: a copy of the user's whose lookups read the tables,
        split over model groups under `Config.parallelism`, under its dense synchronisation."""
        shared = self.config.parallelism == "data"  # model parallelism rewrites the layers
        executed = executed_copy(model, self.sparse_uses, lambda name: self.tables[name],
                                 share_modules=shared)
        # what the program sets on its module tree after distribute reaches what runs
        self._mirror = mirror(model, executed, shared_modules=shared)
        # "model"/"2d" split the linear layers here (in place; the optimizers re-pointed)
        self.parallelism: Parallelism = build_parallelism(
            model, self.config, worker=self.worker, group=self.group, traffic=self.traffic,
            run=self.training_run)
        executed = self.parallelism.prepare(executed, model, self.optimizers)
        self._executed = executed
        # the program's own calls of a table's layer (a penalty on the rows it looked up)
        serve_layer_calls(model, executed, self.sparse_uses, self._layer_call)
        # Parameters every worker holds whole, with a gradient AllReduced (DDP) or exchanged
        # by their table, updated by the user's optimizer. (Under ps/optps the dense ones are
        # pulled from the servers instead: they get no gradient here.)
        split = self.parallelism.is_sharded
        self.replicated_parameters = [p for p in executed.parameters()
                                      if p.requires_grad and not split(p)]
        self.replicated_parameters += [t.replica for t in self.tables.values()
                                       if t.replica is not None]
        self._split_parameters = [p for p in executed.parameters() if split(p)]
        self.dense: DenseSync = build_dense_sync(
            executed, replicated_dense=self.layout.uses_ddp,
            hooks_replaced=self.parallelism.replaces_ddp, optimizers=self.optimizers,
            config=self.config, worker=self.worker, group=self.group, traffic=self.traffic,
            phases=self.phases)
        on_shutdown(self.dense.release)
        self.forward_pass: Forward | ProgramForward = Forward(
            executed, lambda: self.dense.module, self.layout, self._params,
            mirror=self._mirror, sync_mode=self.sync_mode, phases=self.phases,
            device=self.device)

    def _build_step(self) -> None:
        """The step's parts (`parallax.step`) and the hooks after it."""
        worker, group = self.worker, self.group
        self.gradients = StepGradients(
            self.model, self._params, self.layout.all_tables, self.layout.replicas,
            self.replicated_parameters, self._split_parameters, self.parallelism,
            worker=worker, group=group, device=self.device,
            after_aggregation=AFTER_AGGREGATION[self.config.after_aggregation]())
        self.order = LoopOrder(worker, group, self._explained, applies=self.sync_mode.aligned)
        self.view = SingleDeviceView(
            self.model, self._params, self.layout.all_tables, self.parallelism,
            self.shard_optimizer, worker=worker, group=group, device=self.device,
            quiet=self._quiet, serving_global=self.dense.serving_global,
            swaps_dense_values=self.dense.server is not None,
            check_export=lambda: self.order.check_export(self.global_step + 1))
        self.planner.attach(self._executed, self.optimizers, self.shard_optimizer,
                            self.replicated_parameters, self.parallelism, self.pool.threads,
                            completed=self._run_the_program_alone)
        self.checkpoints = Checkpoints(self, self.phases, quiet=self._quiet,
                                       refuse=self.dense.require_aggregated,
                                       after_load=self.sync_mode.after_load)
        self.reporting = Reporting(
            self.config, self.traffic, self.phases, worker=worker, group=group,
            plan=lambda: self.plan, counters=(self.parallelism, self.dense),
            workers_steps=None if self.sync_mode.aligned else self.workers_steps)
        #: run after every step, in this order (`parallax.step.hooks`)
        self.step_hooks: list[StepHook] = [self.planner, self.checkpoints, self.phases,
                                           self.reporting]
        self.round = StepRound(
            self.optimizers, rank=worker.rank, sync_mode=self.sync_mode, dense=self.dense,
            gradients=self.gradients, order=self.order, phases=self.phases,
            progress=self.progress, explained=self._explained, traffic=self.traffic,
            hooks=self.step_hooks, run=self.training_run)

    def _run_the_program_alone(self) -> None:
        """Once the plan is complete: a world of one whose every table is the program's own
        parameter, with nothing split and no DDP, runs the program's module itself, its
        layers their own again (`ProgramForward`): nothing to exchange, nothing done."""
        tables = self.layout.all_tables()
        own = [table for table in tables.values() if isinstance(table, OwnTable)]
        if (self.worker.world_size != 1 or self.layout.pulled_whole or len(own) != len(tables)
                or self._split_parameters or self.dense.module is not self._executed):
            return
        layers_back(self.model)
        self.forward_pass = ProgramForward(self.model, own, phases=self.phases)

    # ---- training (a step is a round: `parallax.step.round`) ---------------------------------
    @property
    def module(self) -> nn.Module:
        """The module the forward runs (under DDP where the dense sync uses it)."""
        return self.dense.module

    def forward(self, inputs: Any) -> Any:
        """The model's output for ``inputs`` (a tensor, a tuple of positional args or a dict of
        keyword args). Collective: sparse rows are pulled from the servers."""
        args, kwargs = ((), inputs) if isinstance(inputs, dict) else (
            (tuple(inputs), {}) if isinstance(inputs, (tuple, list)) else ((inputs,), {}))
        return self.forward_call(args, kwargs)

    def forward_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``model(*args, **kwargs)`` as the user's module returns it (collective). Under
        autograd it belongs to the current step: its rows' gradients are pushed by the next
        `sync_gradients`."""
        args, kwargs = call_to_device(args, kwargs, self.device)
        training, round_ = torch.is_grad_enabled(), self.round
        if training:
            self._requires_grad.check(round_.global_step + 1)
            round_.begin()  # (which may end the step before: the step is read after it)
        # the forward's loop-order check, made by the forward before its first collective
        # (an evaluation forward apart: one rank evaluating alone is named, not hung)
        meet = partial(self.order.meet, Call.FORWARD if training else Call.EVALUATE,
                       round_.global_step + 1)
        with self._explained, self._torch_errors:
            output = self.forward_pass(args, kwargs, meet)
        if self.order.enabled and training:
            # the own loop's loss.backward(): timed, and only one
            watch_backwards(output, self.worker.rank, self.phases)
            self.backward_push.arm()  # replicated tables' .grad ready after it, as DDP's
        return output

    def _layer_call(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Before the program's own call of a table's layer (`parallax.model.loop_reads`):
        collective, so every rank must make it where the others do (the loop's order)."""
        self.order.check(Call.LAYER, self.global_step + 1)
        return call_to_device(args, kwargs, self.device)

    def explain_error(self, error: BaseException) -> Exception | None:
        """``error`` (torch's, uncaught) in parallax's terms with the fix, or None."""
        return self._torch_errors.translate(error)

    def program_gradient(self, param: Tensor) -> ServerGradient | None:
        """What ``param.grad`` answers the program for a server-held parameter of this run
        between its backward and ``optimizer.step()`` (`ServerGradient`: its in-place scaling
        by a number scales the aggregated rows); None elsewhere (refused: the rows are on the
        servers)."""
        name = self._name_of(param)
        if (name is None or name not in self.layout.all_tables() or not self.round.open
                or not self.sync_mode.scales_program_gradients):
            return None
        gradients, round_ = self.gradients, self.round
        return ServerGradient.of(param, lambda factor: gradients.scale_table_grad(
            name, factor, aggregated=round_.pushed))

    def _name_of(self, param: Tensor) -> str | None:
        """``param``'s name in the user's model, if it is one of its parameters."""
        return next((n for n, p in self._params.items() if p is param), None)

    def read_whole(self, param: Tensor) -> Tensor | None:
        """The whole value of ``param`` if it is a parameter of this run's model that the
        servers hold (None otherwise), read from its table for the program's own code
        (`parallax.engine.tables.handles`): collective, every rank in the same place of the
        loop; with autograd, its gradient rows join the step's push."""
        name = self._name_of(param)
        table = self.layout.all_tables().get(name) if name is not None else None
        if table is None or not table.on_servers:
            return None
        self.order.check(Call.READ, self.global_step + 1)
        rows, inverse = table.lookup(torch.arange(table.num_rows, device=self.device))
        return rows[inverse].view(param.shape)

    def step(self, batch: Sequence[Any]) -> Tensor:
        """One synchronous training step on this worker's ``(inputs, targets)``; returns this
        worker's loss (detached)."""
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise ArgumentTypeError(f"rank {self.worker.rank}: Runner.step expects a batch "
                                    f"(inputs, targets), got {type(batch).__name__}")
        inputs, targets = batch
        if self.planner.batch_signature is None:
            self.planner.batch_signature = shapes(batch)
        with self._explained:
            self.zero_grad()
            with self.parallelism.counting():
                output = self.forward(inputs)
                with self.phases.phase("forward"):  # the loss function's share
                    targets = to_device(targets, self.device)
                    loss = checked_loss(self.loss_fn(output, targets), self.worker.rank)
                    self._per_worker_mean.check(targets)
                if self.progress is not None:
                    with self.phases.phase("progress record"):
                        self.progress.phase(self.global_step + 1, "backward")
                self.sync_mode.before_backward()
                if self.sync_mode.carries_riders:  # nothing of the user's before the push
                    self.dense.defer_backward()
                with self.phases.phase("backward"), self._torch_errors:
                    loss.backward()
            self.reporting.note(loss.detach(), float(numel(targets) * self.worker.world_size))
            self.apply_update(self.optimizers, loss=loss)
        return loss.detach()

    def sync_gradients(self, loss: Tensor | None = None, *, scaled: bool = False) -> bool:
        """Push this step's gradient rows to the servers, check finiteness on every rank
        (``loss`` too when given) and clip by `Config.clip_grad_norm`; once per step, later
        calls return the first one's answer. Returns whether the step's update applies
        (False: `Config.nonfinite` skipped it). Collective. ``scaled`` (a loss scaler's
        gradients): push only; the scaler checks and decides."""
        return self.round.gradients_ready(loss, scaled=scaled)

    def unscale_tables(self, optimizers: Sequence[torch.optim.Optimizer],
                       inv_scale: Tensor) -> bool:
        """For `parallax.GradScaler`, after the push: multiply the aggregated rows of the
        tables ``optimizers`` update by ``inv_scale``; returns whether any of them is NaN or
        infinite (collective: the same answer on every rank)."""
        with self._explained:
            return self.gradients.unscale_tables(optimizers, inv_scale)

    def apply_update(self, optimizers: Sequence[torch.optim.Optimizer], *,
                     loss: Tensor | None = None) -> None:
        """Each of ``optimizers``' update: its replicated parameters here, its server-held
        rows on their servers (after `sync_gradients`). Collective."""
        self.round.update(optimizers, loss=loss)

    def skip_update(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """``optimizers`` are done with this step (updated, or skipped by a loss scaler that
        found an overflow); the step ends once every optimizer is."""
        self.round.optimizers_done(optimizers)

    def clip_grad_norm(self, max_norm: float, parameters: Iterable[nn.Parameter] | None = None,
                       *, error_if_nonfinite: bool = False) -> float:
        """Clip the aggregated gradients of ``parameters`` (default: all) by their global L2
        norm, as ``clip_grad_norm_`` does on one device; returns the norm. Collective.
        ``error_if_nonfinite``: raise `NonFiniteError` on a NaN or infinite norm, nothing
        clipped."""
        return self.round.clip(max_norm, parameters, error_if_nonfinite=error_if_nonfinite)

    def clip_grad_value(self, value: float,
                        parameters: Iterable[nn.Parameter] | None = None) -> None:
        """Clamp the aggregated gradients of ``parameters`` (default: all) to ``[-value,
        value]``, as ``clip_grad_value_`` does on one device. Collective (it pushes the
        step's gradients first)."""
        self.round.clamp(value, parameters)

    def global_mean(self, total: Tensor, count: Tensor | float) -> Tensor:
        """`parallax.global_mean` in this run: ``total`` over the count summed over every
        worker, one device's mean (collective where the workers step together)."""
        return global_mean(total, count, worker=self.worker, config=self.config,
                           order=self.order, step=self.global_step + 1,
                           aligned=self.sync_mode.aligned)

    @property
    def global_step(self) -> int:
        """Steps trained since the start of training (across resumes)."""
        return self.round.global_step

    @global_step.setter
    def global_step(self, step: int) -> None:  # a checkpoint's step, restored
        self.round.global_step = step

    @property
    def last_grad_norm(self) -> float | None:
        """The norm `Config.clip_grad_norm` clipped by at the latest step that clipped."""
        return self.gradients.last_norm

    @property
    def skipped_steps(self) -> int:
        """Steps (asynchronously: this worker's pushes) `Config.nonfinite="skip"` skipped."""
        return self.nonfinite.skipped

    def workers_steps(self) -> int:
        """Steps finished by all workers together since the start of training (asynchronous
        workers each run their own steps: a loop that should end after a total amount of
        work, whichever workers did it, reads this)."""
        return self.sync_mode.workers_steps(self.global_step)

    @property
    def asynchronous(self) -> AsyncTraining | None:
        """(Kept for earlier programs.) The asynchronous servers' client, else None."""
        return getattr(self.sync_mode, "training", None)

    @property
    def server_sync(self) -> ServerSync | None:
        """(Kept for earlier programs.) The Plump-DP/Slim-DP client, else None."""
        return self.dense.server

    def headline(self) -> dict[str, float | None]:
        """The numbers for a progress bar since the last call: ``loss``, ``targets_per_s``,
        ``bytes_per_step``, ``step_s`` (`parallax.step.hooks.Reporting.headline`)."""
        return self.reporting.headline()

    def evaluate(self, batches: Iterable[Sequence[Any]]) -> float:
        """Mean loss over the batches of *all* workers (each worker passes its own shard, e.g.
        a `parallax.shard`-ed validation loader), weighted by batch size. Collective: every
        worker must pass the same number of batches."""
        with self.dense.serving_global(), evaluating(self.model, self.module):
            return mean_loss(self.forward, self.loss_fn, batches, group=self.group,
                             device=self.device)

    def zero_grad(self, optimizers: Sequence[torch.optim.Optimizer] | None = None, *,
                  set_to_none: bool = True) -> None:
        """Clear the gradients of every parameter, or of those ``optimizers`` update (their
        replicated parameters here, their tables' rows on the servers), as
        ``Optimizer.zero_grad(set_to_none)`` does on one device. Gradients of forwards not
        yet backpropagated are kept, as on one device."""
        self.gradients.zero_grad(optimizers, set_to_none=set_to_none)

    def _quiet(self) -> Any:
        """A consistent snapshot of the servers' shards while inside (collective)."""
        return self.sync_mode.quiet(self.group)

    # ---- the plan ----------------------------------------------------------------------------
    @property
    def plan(self) -> Plan:
        """Where every parameter lives and why, with predicted bytes (`parallax.Plan`)."""
        return self.planner.plan

    @property
    def local_aggregation(self) -> bool:
        """Whether sparse exchanges go through each machine's leader."""
        return self.planner.local_aggregation

    @property
    def plan_settled(self) -> bool:
        """Whether the plan is final: α measured after the warm-up, the leader hop's trial
        and any partition search done. Steps before it may run another layout (a
        benchmark's timed steps start after)."""
        return self.planner.settled

    def repartition(self, num_partitions: int, names: Iterable[str] | None = None) -> None:
        """Split the server-held sparse tables (all, or those in ``names``) into
        ``num_partitions`` partitions each, keeping their values and optimizer state; training
        continues exactly as before (collective)."""
        self.planner.repartition(num_partitions, names)

    @property
    def partition_searches(self) -> dict[str, SearchRecord]:
        """Per partition group (`parallax.partitioner`), how its count was chosen (empty
        until the search, which starts after the warm-up steps, has finished a group)."""
        return self.planner.searches

    # ---- checkpoints -------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str] | None = None, *, extra: Any = None) -> Path:
        """Write a sharded checkpoint of this step under ``path`` (default
        `Config.checkpoint_dir`): servers write their rows and optimizer state, rank 0 the
        dense part, the positions of the `parallax.shard` loaders and ``extra`` (anything
        ``torch.save`` takes, e.g. an lr scheduler's state). Collective; returns the step
        directory."""
        return self.checkpoints.save(path, extra=extra)

    def load(self, path: str | os.PathLike[str] | None = None) -> Any:
        """Restore the checkpoint at ``path`` (a step directory), or the newest complete one
        under it (default `Config.checkpoint_dir`), on this cluster whatever its shape and
        partition counts were: parameters, optimizer state, step, loader positions (and
        random generators when the worker count is the same). Returns the saved ``extra``.
        Collective."""
        return self.checkpoints.load(path)

    # ---- the single-device view (`parallax.checkpoint.single_device`) -------------------------
    def state_dict(self) -> dict[str, Tensor]:
        """A plain single-device ``state_dict`` of the original model class (collective: on
        every rank, not only on the one that saves it)."""
        return self.view.state_dict()

    def sharded_state_dict(self) -> dict[str, Tensor]:
        """`state_dict`, except that model parallelism's split weights stay this rank's
        DTensor shards (not gathered): what `parallax.checkpoint.save_dcp` hands DCP, which
        writes each shard from its rank. Collective."""
        return self.view.state_dict(whole=False)

    def export(self, path: str | os.PathLike[str]) -> Path | None:
        """Write the plain single-device ``state_dict`` to ``path`` on rank 0 (collective),
        streamed: each server-held table comes from its servers in chunks of rows written
        straight into the file (`parallax.checkpoint.streamed`), so no process ever holds a
        whole table in memory (`state_dict` gathers each one whole on every rank). Returns
        ``path`` on rank 0, None elsewhere; ``torch.load(path, mmap=True)`` reads it the same
        way."""
        return self.view.export(path)

    def load_state_dict(self, state: dict[str, Tensor], *, strict: bool = True) -> Any:
        """Load a plain single-device ``state_dict`` of the original model class (every rank
        passes the same values): into the model, and the server-held rows onto their servers.
        Optimizer state is untouched, as on one device. Returns what
        ``nn.Module.load_state_dict`` returns."""
        return self.view.load_state_dict(state, strict=strict)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """``optimizer.state_dict()`` as on one device (collective): the state of its
        server-held parameters is gathered from the servers, each per-row tensor whole on
        every rank (as `state_dict` gathers the tables; for tables larger than memory,
        checkpoint with `save`)."""
        return self.view.optimizer_state_dict(optimizer)

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str,
                                  Any]) -> None:
        """``optimizer.load_state_dict(state)`` of a single-device state dict (every rank
        passes the same): each server takes its rows of a server-held parameter's state,
        the optimizer object the rest."""
        self.view.load_optimizer_state_dict(optimizer, state)

    # ---- numbers -----------------------------------------------------------------------------
    def predicted_memory(self) -> MemoryEstimate:
        """The bytes this rank holds for training by the memory model
        (`parallax.planning.memory`): what it keeps whole, its own shards, their gradients,
        optimizer state and the buffers."""
        return predict_memory(self._executed, self.layout.all_tables(), self._params,
                              self.optimizers,
                              uses_ddp=self.layout.uses_ddp and not self.parallelism.replaces_ddp,
                              pulled_whole=self.layout.pulled_whole)

    def stats(self) -> dict[str, dict[str, float]]:
        """Per parameter, the bytes this worker moved per step (intra-/inter-machine), and the
        seconds per step of each phase under ``"step phases"`` (`Reporting.stats`)."""
        return self.reporting.stats()

    def inter_machine_bytes(self) -> dict[str, float]:
        """Per parameter, the measured bytes (sent + received) crossing machines per machine
        and step, averaged over machines: what the plan's ``predicted_bytes`` predict; plus,
        as entries of their own, the dense syncs that count per message (``"dense (qsgd)"``,
        ``"dense (push)"``, ``"dense (pull)"``, ``"dense (explorer keys)"``, ``"dense (core
        keys)"``: 0 under the others), so that the values add up to every byte of a step
        (collective)."""
        return self.reporting.inter_machine_bytes()

    @property
    def dense_sync_seconds(self) -> float:
        """Seconds this worker spent synchronising dense parameters since the start or the
        last ``reset_stats``: inside the synchronous comm hooks (``hierarchical``, ``qsgd``:
        collectives, encoding, decoding) or the servers' rounds (``plump``, ``slim``: core
        selection and exploration too); 0 for ``flat`` (asynchronous: it overlaps the
        backward) and for a model with no replicated dense parameter."""
        return self.dense.seconds

    def reset_stats(self) -> None:
        """Restart the byte counts of `stats` and `dense_sync_seconds`."""
        self.reporting.reset()
