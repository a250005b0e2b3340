"""What happens after a step, as step hooks: each gets `StepDone` once the step's updates are
done, in the order the runner lists them (the plan's warm-up and partition search,
`parallax.step.plan_keeper`; the checkpoint schedule, `parallax.step.checkpoints`; the phase
clock's end of step; the numbers for TensorBoard and a progress bar, `Reporting`; and
``parallax verify``'s recorder). A hook is any object with ``after_step(done)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from parallax.cluster import WorkerInfo
from parallax.config import Config
from parallax.engine.dense_sync.qsgd import TRAFFIC_NAME as QSGD_ACCOUNT
from parallax.engine.dense_sync.server_sync import CORE_KEYS, KEYS, PULL, PUSH
from parallax.engine.diagnostics.phases import PHASES, STATS_KEY, PhaseClock
from parallax.engine.tables.exchange import Traffic
from parallax.metrics import MetricsLog, Window
from parallax.planning.plan import Plan
from parallax.session import on_shutdown

__all__ = ["Reporting", "StepDone", "StepHook"]


#: where `dense_sync="qsgd"`, ``"plump"`` and ``"slim"`` count their bytes (per message, not
#: per parameter): `inter_machine_bytes` adds them (they were missing from it, which read 0
#: for a Slim-DP run against 0 for Plump-DP)
DENSE_SYNC_ACCOUNTS = (QSGD_ACCOUNT, PUSH, KEYS, PULL, CORE_KEYS)


@dataclass(frozen=True)
class StepDone:
    """A finished step: ``step`` since the start of training (across resumes),
    ``steps_here`` in this process, ``seconds`` from its first forward to its end."""

    step: int
    steps_here: int
    seconds: float


class StepHook(Protocol):
    def after_step(self, done: StepDone) -> None: ...


class Resettable(Protocol):
    def reset(self) -> None: ...


class Reporting:
    """The numbers of the steps: `Config.log_dir`'s TensorBoard scalars from rank 0 every
    `Config.log_every_steps`, and `headline` for a progress bar. ``workers_steps`` (None:
    the workers are in step) gives the steps all workers finished together, which
    asynchronous workers count their target elements by."""

    def __init__(self, config: Config, traffic: Traffic, phases: PhaseClock, *,
                 worker: WorkerInfo, group: dist.ProcessGroup, plan: Callable[[], Plan],
                 workers_steps: Callable[[], int] | None, counters: Sequence[Resettable]
                 ) -> None:
        self.config = config
        self.traffic = traffic
        self.phases = phases
        self.worker = worker
        self.world_size = worker.world_size
        self.group = group
        self.plan = plan
        self.workers_steps = workers_steps
        self.counters = counters  # what `reset` restarts besides the bytes and phases
        self.metrics = MetricsLog(config.log_dir, rank=worker.rank,
                                  every=config.log_every_steps)
        on_shutdown(self.metrics.close)
        self._headline = Window()
        self._loss: float | torch.Tensor | None = None  # Runner.step's, for the metrics
        self._targets: float | None = None
        self._last_targets: float | None = None  # the latest step's, all workers
        self._steps_at = {"metrics": 0, "headline": 0}

    def start(self) -> None:
        """Training begins (after any resume): the windows count from here."""
        if self.workers_steps is not None:
            self._steps_at = dict.fromkeys(self._steps_at, self.workers_steps())

    def note(self, loss: float | torch.Tensor, targets: float) -> None:
        """`Runner.step`'s loss and every worker's target elements, for this step."""
        self._loss, self._targets = loss, targets

    def after_step(self, done: StepDone) -> None:
        """The step into the headline's and the metrics' windows; rank 0 writes every
        `Config.log_every_steps` steps."""
        loss, targets = self._loss, self._targets
        self._loss = self._targets = None
        self._headline.add(loss, targets)
        self.metrics.window.add(loss, targets)
        self._last_targets = targets if targets is not None else self._last_targets
        if self.metrics.due(done.step):
            numbers = self._take(self.metrics.window, "metrics")
            self.metrics.write(done.step, numbers, self.plan(), str(self.config.architecture))

    def headline(self) -> dict[str, float | None]:
        """The numbers for a progress bar, over the steps since the last call: ``loss``
        (this rank's, `Runner.step` only), ``targets_per_s`` (every worker's target elements
        per second: words of an LM, samples of a classifier), ``bytes_per_step`` (what this
        rank sent and received) and ``step_s``. Not collective."""
        numbers = self._take(self._headline, "headline")
        return {"loss": numbers["loss"], "targets_per_s": numbers["targets_per_s"],
                "bytes_per_step": sum(numbers["bytes"].values()),
                "step_s": numbers["phases"].get("step", 0.0)}

    def stats(self) -> dict[str, dict[str, float]]:
        """Bytes this worker sent and received per training step through the parameter-server
        and AllGatherv exchanges, per parameter, split into intra- and inter-machine traffic;
        and under ``"step phases"`` the seconds per step of each phase of the step on this
        rank (`parallax.engine.diagnostics.phases.PHASES`, self times: they add up to ``"step"``
        with ``"other"``, what no phase covers). Averaged over the steps since the start or the
        last `reset`."""
        return {**self.traffic.per_step(), STATS_KEY: self.phases.per_step()}

    def inter_machine_bytes(self) -> dict[str, float]:
        """See `Runner.inter_machine_bytes` (collective). The dense syncs that count their
        traffic per message rather than per parameter (`DENSE_SYNC_ACCOUNTS`) are entries of
        their own, so that the sum is every byte the step moved."""
        names = [p.name for p in self.plan().parameters] + list(DENSE_SYNC_ACCOUNTS)
        per_step = self.traffic.per_step()
        values = torch.tensor(
            [per_step.get(n, {}).get("inter_sent", 0.0)
             + per_step.get(n, {}).get("inter_received", 0.0) for n in names],
            dtype=torch.float64, device=self.worker.device)
        dist.all_reduce(values, group=self.group)
        values /= len(self.worker.server_ranks)
        return dict(zip(names, values.tolist(), strict=True))

    def reset(self) -> None:
        """Restart the byte counts, the phase times and the ``counters``."""
        self.traffic.reset()
        self.phases.reset()
        for counter in self.counters:
            counter.reset()

    def _take(self, window: Window, name: str) -> dict[str, Any]:
        """``window``'s numbers. Asynchronous workers are not in step: their target elements
        are what all of them finished since the window began (rank 0's batch size each)."""
        targets = None
        if self.workers_steps is not None and self._last_targets is not None:
            done = self.workers_steps()
            targets = (done - self._steps_at[name]) * self._last_targets / self.world_size
            self._steps_at[name] = done
        seconds = {name: self.phases.seconds.get(name, 0.0) for name in (*PHASES, "step")}
        sent = {name: float(sum(counts.values())) for name, counts in self.traffic.bytes.items()}
        numbers = window.take(sent, seconds, targets=targets)
        step = numbers["phases"].pop("step")
        numbers["phases"]["other"] = max(0.0, step - sum(numbers["phases"].values()))
        numbers["phases"]["step"] = step
        return numbers
