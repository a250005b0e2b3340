"""The step round, explicit: one training step from its first training forward to the moment
every optimizer has stepped.

    begin (a training forward; a second one accumulates)
      -> gradients_ready (the sync mode's push, finiteness, `Config` clipping: once, whatever
         asks first: ``optimizer.step()``, ``clip_grad_norm_``, a loss scaler)
      -> update / optimizer_done (each optimizer's update, or a loss scaler's skip)
      -> end (every optimizer done, or the next step's forward comes): the dense sync's end
         of step, then the step hooks get `StepDone`, what the step did.

`Runner.step` drives a round itself; under `parallax.distribute` the user's loop drives the same
round through the model, ``optimizer.step()`` and ``clip_grad_norm_``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, nn

from parallax.engine.dense_sync.strategy import DenseSync
from parallax.engine.diagnostics.phases import PhaseClock
from parallax.engine.diagnostics.progress import Explainer, Progress
from parallax.engine.optimizers.replica_rows import touched_rows_only
from parallax.engine.tables import handles
from parallax.engine.tables.exchange import Traffic
from parallax.errors import UnsupportedProgramError
from parallax.loader import check_resumed
from parallax.runs import TrainingRun
from parallax.step import hyperparameters
from parallax.step.gradients import StepGradients
from parallax.step.hooks import StepDone, StepHook
from parallax.step.loop_order import Call, LoopOrder
from parallax.step.sync_modes import SyncMode

__all__ = ["StepRound"]


class StepRound:
    """The rounds of ``optimizers`` (the program's, all of which step once per step), through
    the run's parts; ``hooks`` run after every step, in order."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer], *, rank: int,
                 sync_mode: SyncMode, dense: DenseSync, gradients: StepGradients,
                 order: LoopOrder, phases: PhaseClock, progress: Progress | None,
                 explained: Explainer, traffic: Traffic, hooks: list[StepHook],
                 run: TrainingRun) -> None:
        self._all = {id(optimizer) for optimizer in optimizers}
        self.optimizers = list(optimizers)
        self.rank = rank
        self.sync_mode = sync_mode
        self.dense = dense
        self.gradients = gradients
        self.order = order
        self.phases = phases
        self.progress = progress
        self.explained = explained
        self.traffic = traffic
        self.hooks = hooks
        self.run = run  # a runner made after this step begins belongs to a new run
        self.global_step = 0  # since the start of training, across resumes
        self.steps_here = 0  # in this process (the warm-up counts these)
        self._stepped: set[int] = set()
        self.open = False  # between the step's first training forward and its end
        self._synced = False  # its gradients are pushed and checked
        self._applies = False  # its update applies (False: Config.nonfinite skipped it)
        self._began = 0.0

    @property
    def pushed(self) -> bool:
        """Whether this step's gradient rows are pushed and aggregated."""
        return self._synced

    def begin(self) -> None:
        """A training forward comes: it opens the step, or joins the open one (gradient
        accumulation); after some optimizers stepped it belongs to the next step."""
        if self._stepped:
            self.end()
        if not self.open:
            self.open = True
            if not self.run.stepped:  # the run's first step: its loaders took the resume's
                check_resumed(self.run, self.rank)
            self.run.stepped = True
            self._began = time.perf_counter()
            step = self.global_step + 1
            self.phases.begin(step)
            if self.progress is not None:
                with self.phases.phase("progress record"):
                    self.progress.begin(step)
            self.sync_mode.begin_step(step)
        self._synced = False  # its gradients join the step's: push them too

    def gradients_ready(self, loss: Tensor | None = None, *, scaled: bool = False) -> bool:
        """See `Runner.sync_gradients`."""
        if not self.open:
            raise UnsupportedProgramError(
                f"rank {self.rank}: a gradient update with no forward through the "
                f"distributed model since the last step (step {self.global_step + 1}); "
                f"gradients of a parallax model come from its forward: call the model that "
                f"parallax.distribute returned, then backward, then optimizer.step()")
        if self._synced:
            return self._applies
        if scaled and self.sync_mode.config.clip_grad_norm is not None:
            raise UnsupportedProgramError(
                "Config.clip_grad_norm would clip the loss scaler's scaled gradients: clip "
                "with parallax.clip_grad_norm_ after scaler.unscale_(optimizer) instead")
        self.gradients.check_none_outside_lookups()
        with self.explained:
            self._check_order_and_settings()
            settings = self._settings_rider()
            riders = self.dense.riders()
            self._applies = self.sync_mode.push(
                self.gradients, loss, scaled=scaled, step=self.global_step + 1,
                riders=riders if settings is None else [*riders, settings])
            if settings is not None and settings.differs():
                self._name_different_settings()
            self._synced = True
        return self._applies

    def _settings_rider(self) -> hyperparameters.SettingsRider | None:
        """Under `Runner.step` (no loop order check to carry them), the optimizers'
        settings ride in the push where the workers step together."""
        order = self.order
        if order.enabled or not order.applies:
            return None
        return hyperparameters.SettingsRider(self.optimizers, world=order.worker.world_size,
                                             device=order.worker.device)

    def _name_different_settings(self) -> None:
        """Raise on every rank naming the setting that differs (collective)."""
        hyperparameters.name_the_difference(
            self.optimizers, rank=self.rank, world=self.order.worker.world_size,
            group=self.order.group, step=self.global_step + 1)

    def _check_order_and_settings(self) -> None:
        """The loop order's check of this update, which carries the optimizers' settings'
        fingerprint (`parallax.step.hyperparameters`) where the check applies."""
        step, order = self.global_step + 1, self.order
        if not (order.enabled and order.applies):
            return
        everyone = order.gather_numbers(Call.UPDATE, step,
                                        [hyperparameters.fingerprint(self.optimizers)])
        if any([row != everyone[0] for row in everyone]):
            self._name_different_settings()

    def clip(self, max_norm: float, parameters: Iterable[nn.Parameter] | None = None, *,
             error_if_nonfinite: bool = False) -> float:
        """See `Runner.clip_grad_norm`: the gradients made ready, then clipped."""
        self._require_aggregated("clipping by the global norm of the aggregated gradients")
        self.gradients_ready()
        with self.explained:
            return self.gradients.clip(max_norm, parameters,
                                       error_if_nonfinite=error_if_nonfinite)

    def clamp(self, value: float, parameters: Iterable[nn.Parameter] | None = None) -> None:
        """See `Runner.clip_grad_value`: the gradients made ready, then clamped."""
        self._require_aggregated("clipping the aggregated gradients by value")
        self.gradients_ready()
        with self.explained:
            self.gradients.clamp(value, parameters)

    def _require_aggregated(self, what: str) -> None:
        """Refuse ``what`` where no aggregated gradient exists to act on."""
        self.sync_mode.require_aligned(
            what, "the servers apply each worker's push on its own; Config(clip_grad_norm=...) "
                  "clips each push (sync='async')")
        self.dense.require_aggregated(
            what, "each worker updates its own dense copy from its own gradients, there is no "
                  "aggregated dense gradient; use dense_sync='hierarchical' or 'qsgd' to clip")

    def update(self, optimizers: Sequence[torch.optim.Optimizer], *,
               loss: Tensor | None = None) -> None:
        """See `Runner.apply_update`."""
        if self.gradients_ready(loss):
            with self.explained:
                with (self.phases.phase("dense update"), handles.internal(),
                      touched_rows_only(self.gradients.replicas(), optimizers)):
                    for optimizer in optimizers:
                        dense_step = getattr(optimizer, "parallax_dense_step", None)
                        (dense_step or optimizer.step)()
                self.sync_mode.update(optimizers)
        self.optimizers_done(optimizers)

    def optimizers_done(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """``optimizers`` stepped (or skipped); the step ends once every optimizer has."""
        self._stepped.update(map(id, optimizers))
        if self._stepped >= self._all:
            self.end()

    def end(self) -> StepDone:
        """Close the step: the dense sync's end of step, the counters, then the hooks."""
        with self.explained:
            self.dense.end_step(self.global_step + 1)
        if self.progress is not None:
            with self.phases.phase("progress record"):
                self.progress.done(self.global_step + 1)
        self.open = self._synced = False
        self._stepped.clear()
        self.traffic.steps += 1
        self.steps_here += 1
        self.global_step += 1
        self.sync_mode.end_step()
        done = StepDone(self.global_step, self.steps_here, time.perf_counter() - self._began)
        for hook in self.hooks:
            hook.after_step(done)
        return done
