"""`Config.sync` as a strategy: how a step's sparse rows travel and when the servers apply
them. The runner picks one mode at construction and calls it at fixed points of the step; it
never asks which mode it holds.

* `Synchronous` (``"sync"``): every worker pushes its gradient rows in one collective exchange
  per step, all workers agree on finiteness and the clipping norm, and the servers apply the
  user's optimizer to the summed rows once every worker has pushed. Exactly one device's
  training with the global batch.
* `Asynchronous` (``"async"``, ``"async-sparse"``): server threads apply each worker's push as it
  arrives (`parallax.engine.asynchronous.async_training`); workers run on their own clocks, bounded
  by `Config.max_staleness`.

The contract is three step methods (``prefetch``, ``push``, ``update``) plus the life-cycle
calls a mode may ignore (``start``, ``begin_step``, ``end_step``, ``quiet``, ``after_load``).
``aligned`` says whether the workers are in the same step, which the features that compare or
combine the workers' steps (loop-order checks, global clipping, the partition search,
re-partitioning, moving a table to AllReduce) require; ``require_aligned`` refuses them.
Adding a mode is one class here and an entry in `SYNC_MODES`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor

from parallax.cluster import WorkerInfo
from parallax.config import Config, SyncName
from parallax.engine.asynchronous.async_table import AsyncTable
from parallax.engine.asynchronous.async_training import AsyncTraining
from parallax.engine.diagnostics.phases import PhaseClock
from parallax.engine.diagnostics.progress import Progress
from parallax.engine.optimizers.grad_norm import clip_by_global_norm
from parallax.engine.optimizers.shard_optimizer import ShardOptimizer
from parallax.engine.tables.early_push import EarlyPush
from parallax.engine.tables.exchange import Traffic
from parallax.engine.tables.layout import Layout
from parallax.engine.tables.riders import Rider, settle
from parallax.engine.tables.row_exchange import prefetch
from parallax.engine.tables.server_table import ShardedTable
from parallax.engine.tables.table import Table, held_tables, push_all
from parallax.engine.tables.verdict import Verdict
from parallax.errors import ConfigError, UnsupportedProgramError
from parallax.model.detect import SparseUse
from parallax.session import on_shutdown
from parallax.step.gradients import StepGradients
from parallax.step.nonfinite import NonFinitePolicy

__all__ = ["SYNC_MODES", "Asynchronous", "SyncMode", "Synchronous", "build_sync_mode"]


class SyncMode:
    """The contract, with the life-cycle calls' defaults (nothing to do)."""

    #: every worker is in the same step (see the module)
    aligned: ClassVar[bool] = True
    #: the push is one message to every rank after the backward, which riders can take
    #: (`parallax.engine.tables.riders`; `Runner.step` then defers the dense sum to it)
    carries_riders: ClassVar[bool] = False
    #: the program's in-place scaling of a server-held ``.grad`` (``p.grad.div_(k)``) applies
    #: to the aggregated rows (`StepGradients.apply_program_scales`, in `push`)
    scales_program_gradients: ClassVar[bool] = False

    def __init__(self, config: Config, worker: WorkerInfo, phases: PhaseClock,
                 nonfinite: NonFinitePolicy, layout: Layout, *,
                 sparse_uses: dict[str, SparseUse], traffic: Traffic) -> None:
        self.config = config
        self.worker = worker
        self.phases = phases
        self.nonfinite = nonfinite
        self.layout = layout
        self.shard_optimizer: ShardOptimizer | None = None  # given by `start`

    # ---- the step ----------------------------------------------------------------------------
    def prefetch(self, tables: Sequence[Table], ids: Sequence[Sequence[Tensor]],
                 ) -> contextlib.AbstractContextManager[None]:
        """Pull now, in one exchange, the rows of ``ids`` (per server-held table) that the
        coming forward reads; while inside, the tables' lookups are served from them."""
        raise NotImplementedError

    def push(self, gradients: StepGradients, loss: Tensor | None, *, scaled: bool,
             step: int, riders: Sequence[Rider] = ()) -> bool:
        """Send this step's gradient rows to the servers and check them (`Config.nonfinite`,
        `Config.clip_grad_norm`); whether the step's update applies. ``scaled``: a loss
        scaler's gradients (the scaler checks them). ``riders``: to every rank, in the
        push's messages where the mode has them (`parallax.engine.tables.riders`)."""
        raise NotImplementedError

    def update(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """The servers' share of ``optimizers``' update (after the dense update)."""
        raise NotImplementedError

    # ---- life cycle --------------------------------------------------------------------------
    def start(self, shard_optimizer: ShardOptimizer, step: int,
              progress: Progress | None) -> None:
        """Training begins at ``step`` (after any resume) with the servers' optimizer."""
        self.shard_optimizer = shard_optimizer

    def begin_step(self, step: int) -> None:
        """Step ``step``'s first training forward comes."""

    def end_step(self) -> None:
        """The step's updates are done."""

    def quiet(self, group: dist.ProcessGroup) -> contextlib.AbstractContextManager[None]:
        """While inside, the servers' shards are a consistent snapshot (collective)."""
        return contextlib.nullcontext()

    def after_load(self, step: int) -> None:
        """A checkpoint of ``step`` was restored."""

    def warmup_steps(self, requested: int) -> int:
        """The warm-up steps this mode can take of the ``requested`` (measuring α is a
        collective over the workers' steps)."""
        return requested

    def after_warmup(self, group: dist.ProcessGroup) -> None:
        """The warm-up steps are done (their tables' use is measured)."""

    def before_backward(self) -> None:
        """`Runner.step`'s backward comes (its own loop's backward is the user's)."""

    def workers_steps(self, own_steps: int) -> int:
        """Steps finished by all workers together (``own_steps``: this worker's, since the
        start of training)."""
        return own_steps * self.worker.world_size

    def require_aligned(self, what: str, fix: str) -> None:
        """Refuse ``what`` (with its ``fix``) when the workers' steps are not aligned."""


class Synchronous(SyncMode):
    """``Config.sync="sync"``: see the module."""

    carries_riders = True
    scales_program_gradients = True

    def __init__(self, config: Config, worker: WorkerInfo, phases: PhaseClock,
                 nonfinite: NonFinitePolicy, layout: Layout, *,
                 sparse_uses: dict[str, SparseUse], traffic: Traffic) -> None:
        super().__init__(config, worker, phases, nonfinite, layout, sparse_uses=sparse_uses,
                         traffic=traffic)
        # Runner.step's gradient rows leave during its backward (Config.overlap_push)
        self.early = EarlyPush(worker.rank) if config.overlap_push else None

    def prefetch(self, tables: Sequence[Table], ids: Sequence[Sequence[Tensor]],
                 ) -> contextlib.AbstractContextManager[None]:
        held = list(held_tables({table.name: table for table in tables}).values())
        prefetch(held, ids)
        return _serving_pulled(held)

    def push(self, gradients: StepGradients, loss: Tensor | None, *, scaled: bool,
             step: int, riders: Sequence[Rider] = ()) -> bool:
        verdict = Verdict(loss=loss)  # (its loss checked only if a push carries it)
        exchanged = [t for t in self.layout.all_tables().values() if t.exchanges]
        if exchanged or riders:  # (nothing to push: a world of one's own tables)
            with self.phases.phase("push"):
                if self.early is not None:
                    self.early.flush()  # what Runner.step's backward did not push yet
                push_all(exchanged, verdict, riders)
                if (not verdict.carried and any([r.waiting is not None for r in riders])
                        and not any([t.on_servers for t in exchanged])):
                    # (no server-held table: the verdict is the losses', riding with them)
                    verdict.prepare_alone(world=self.worker.world_size,
                                          device=self.worker.device)
                # those no message took (no server-held table was used), in one message
                settle([*riders, verdict], None)
                # (Config.after_aggregation: by default the servers averaged as rows arrived)
                gradients.after_aggregation.average(exchanged, verdict)
        if gradients.parallelism.reduces_gradients:
            with self.phases.phase("dense sync"):
                gradients.reduce_split_layers()
        with self.phases.phase("clip and check"):
            gradients.apply_program_scales()  # the program's p.grad.div_(k), before clipping
            gradients.tables_squared = None
            if verdict.carried:  # which tables any backward reached: in the verdict
                gradients.agree_by(verdict)
            if scaled:  # the scaler checks finiteness
                if not verdict.carried:
                    gradients.agree_on_tables()
                applies = True
            else:
                applies = self._finite_or_skip(gradients, loss, step, verdict)
            if applies and self.config.clip_grad_norm is not None:
                gradients.last_norm = gradients.clip(self.config.clip_grad_norm)
        return applies

    def _finite_or_skip(self, gradients: StepGradients, loss: Tensor | None,
                        step: int, verdict: Verdict) -> bool:
        """All workers decide alike, before anything is updated, whether the step applies:
        by the push's verdict where it proves the step finite (and no clipping needs the
        norm), else by the full check (a collective that names what is not finite)."""
        if not self.nonfinite.checks:
            if not verdict.carried:
                gradients.agree_on_tables()
            return True
        if (verdict.carried and self.config.clip_grad_norm is None
                and gradients.finite_by(verdict)):
            return True
        found = gradients.find_nonfinite(loss)
        if self.nonfinite.applies(
                found.describe(), step=step, lost="no parameter was updated",
                skipping="skips such steps",
                warn="parallax: step %d skipped (NaN or infinite %s)"
                if self.worker.rank == 0 else None):
            return True
        gradients.zero_grad()
        return False

    def update(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        assert self.shard_optimizer is not None, "Synchronous.update before start"
        # (every rank times it, a server of no shard too, while any table is on the servers)
        if any(table.on_servers for table in self.layout.all_tables().values()):
            with self.phases.phase("server update"):
                self.shard_optimizer.step(optimizers)

    def before_backward(self) -> None:
        """`Config.overlap_push`: the server-held rows leave during the backward."""
        if self.early is not None:
            self.early.arm(list(held_tables(self.layout.all_tables()).values()))

    def after_warmup(self, group: dist.ProcessGroup) -> None:
        """The early push learns the tables' backward order."""
        if self.early is not None:
            schedule = self.early.learn(group)
            # (the next pulls group tables within the schedule's items only)
            self.layout.steps.schedule_pushes(schedule)


class Asynchronous(SyncMode):
    """``Config.sync="async"``/``"async-sparse"``: see the module. Replaces the layout's
    server-held tables by their asynchronous wrappers (collective to build)."""

    aligned = False

    def __init__(self, config: Config, worker: WorkerInfo, phases: PhaseClock,
                 nonfinite: NonFinitePolicy, layout: Layout, *,
                 sparse_uses: dict[str, SparseUse], traffic: Traffic) -> None:
        super().__init__(config, worker, phases, nonfinite, layout, sparse_uses=sparse_uses,
                         traffic=traffic)
        _refuse_batch_dependent(sparse_uses, config)
        refuse_off_cpu(worker.device, config)
        self.training = AsyncTraining(
            held_tables(layout.all_tables()),
            worker=worker, max_staleness=config.max_staleness,
            timeout_s=config.collective_timeout_s, traffic=traffic)
        for name, table in self.training.tables.items():
            kind: dict[str, Any] = layout.sparse if name in layout.sparse else layout.pulled_whole
            kind[name] = table

    def prefetch(self, tables: Sequence[Table], ids: Sequence[Sequence[Tensor]],
                 ) -> contextlib.AbstractContextManager[None]:
        wrappers = [self.training.tables[table.name] for table in tables]
        AsyncTable.prefetch_together(wrappers, ids)
        return _serving_pulled(wrappers)

    def push(self, gradients: StepGradients, loss: Tensor | None, *, scaled: bool,
             step: int, riders: Sequence[Rider] = ()) -> bool:
        """This worker's own checks, then its push (returns once every server applied it).
        The non-finite check needs no collective: the dense gradient is the same on every
        worker (AllReduced, or none under "async"), the pushed rows are this worker's own, so
        a bad push is dropped (or raised) here alone. Returns whether the dense update
        applies."""
        if scaled:
            raise UnsupportedProgramError(
                f"rank {self.worker.rank}: a loss scaler (parallax.GradScaler) under sync="
                f"{str(self.config.sync)!r}: its overflow check needs every worker's scaled "
                f"gradient of the same step; asynchronous servers apply each push on its own")
        settle(riders, None)  # (none come: `carries_riders` is False)
        tables = list(self.training.tables.values())
        with self.phases.phase("clip and check"):
            dense_ok = self._check_and_clip(gradients, loss, tables, step)
        with self.phases.phase("push"):
            AsyncTable.push_together(tables)
        return dense_ok

    def _check_and_clip(self, gradients: StepGradients, loss: Tensor | None,
                        tables: list[AsyncTable], step: int) -> bool:
        """`Config.nonfinite` and `Config.clip_grad_norm` on this worker's own push."""
        dense_ok = True
        if self.nonfinite.checks:
            bad_dense = [n for n, p in gradients.replicated_named()
                         if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
            bad_own = [t.name for t in tables if t.own_nonfinite()]
            if loss is not None and not bool(torch.isfinite(loss.detach()).all()):
                bad_own.insert(0, "loss")
            if not self.nonfinite.applies(
                    ", ".join(bad_own + bad_dense), step=step, lost="this worker pushed nothing",
                    skipping="drops such pushes",
                    warn=f"parallax: rank {self.worker.rank}, step %d: push dropped "
                         f"(NaN or infinite %s)"):
                self.training.skip_push = True
                dense_ok = not bad_dense
        if self.config.clip_grad_norm is not None and not self.training.skip_push:
            # this worker's own push (its tables' norms are its own: no collective)
            own = sum((t.grad_norm_squared() for t in tables),
                      torch.zeros((), dtype=torch.float64))
            gradients.last_norm = clip_by_global_norm(
                self.config.clip_grad_norm, [], tables,
                tables_squared=own, group=gradients.group, device=gradients.device)
        return dense_ok

    def update(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Nothing: the servers applied each push as it came."""

    def start(self, shard_optimizer: ShardOptimizer, step: int,
              progress: Progress | None) -> None:
        super().start(shard_optimizer, step, progress)
        self.training.start(shard_optimizer, step)
        # held strongly: another rank's server waits for this one's stop message
        on_shutdown(functools.partial(AsyncTraining.close, self.training))
        if progress is not None and self.config.sync == "async":
            progress.ends_freely = True  # workers finish on their own clocks

    def begin_step(self, step: int) -> None:
        self.training.before_step(step)  # the staleness bound's wait

    def end_step(self) -> None:
        self.training.after_step()

    def quiet(self, group: dist.ProcessGroup) -> contextlib.AbstractContextManager[None]:
        return self.training.quiet(group)

    def after_load(self, step: int) -> None:
        self.training.gate.start(step)

    def workers_steps(self, own_steps: int) -> int:
        return self.training.global_steps()

    def warmup_steps(self, requested: int) -> int:
        """None under "async": measuring α is a collective, and its workers never meet."""
        return 0 if self.config.sync == "async" else requested

    def require_aligned(self, what: str, fix: str) -> None:
        raise UnsupportedProgramError(
            f"rank {self.worker.rank}: {what} under sync={str(self.config.sync)!r}: {fix}")


@contextlib.contextmanager
def _serving_pulled(tables: Sequence[ShardedTable] | Sequence[AsyncTable]) -> Iterator[None]:
    """While inside, ``tables``' lookups read the rows just pulled for them; after, those
    rows are forgotten (the next forward pulls its own)."""
    try:
        yield
    finally:
        for table in tables:
            table.forget_prefetched()


def _refuse_batch_dependent(sparse_uses: dict[str, SparseUse], config: Config) -> None:
    """Refuse lookups whose result depends on every worker's ids of the same step."""
    for name, use in sparse_uses.items():
        if use.batch_dependent is not None:
            raise UnsupportedProgramError(
                f"parameter '{name}' is looked up with max_norm or scale_grad_by_freq, "
                f"whose result depends on every worker's ids of the same step; under "
                f"sync={str(config.sync)!r} the workers' steps are not aligned. Use "
                f"sync='sync' for this model, or drop the option.")


def refuse_off_cpu(device: torch.device, config: Config) -> None:
    """Refuse an asynchronous mode on a GPU worker. Its point-to-point channel is a gloo
    group that carries CPU tensors, and the rows it receives are placed in CPU buffers; no
    path stages them through the host yet, and none has run on a GPU (the GPU path)."""
    if device.type != "cpu":
        raise ConfigError(
            f"sync={str(config.sync)!r} runs on CPU workers only: its parameter servers talk "
            f"over gloo point-to-point, which has not been made to carry this worker's "
            f"{device} tensors. Use sync='sync' on GPUs, or run the workers on the CPU "
            f"(CUDA_VISIBLE_DEVICES=).")


#: every sync mode, by its `Config.sync` names
SYNC_MODES: dict[SyncName, type[SyncMode]] = {
    SyncName.SYNC: Synchronous, SyncName.ASYNC: Asynchronous,
    SyncName.ASYNC_SPARSE: Asynchronous,
}


def build_sync_mode(config: Config, worker: WorkerInfo, phases: PhaseClock,
                    nonfinite: NonFinitePolicy, layout: Layout, *,
                    sparse_uses: dict[str, SparseUse], traffic: Traffic) -> SyncMode:
    """The mode `Config.sync` names (collective: an asynchronous mode connects its servers).
    Build it before anything reads the layout's tables: it may replace them."""
    return SYNC_MODES[SyncName(config.sync)](config, worker, phases, nonfinite, layout,
                                        sparse_uses=sparse_uses, traffic=traffic)
