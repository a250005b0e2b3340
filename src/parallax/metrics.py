"""Training metrics: the headline numbers of recent steps (`Runner.headline`, for a progress
bar) and, with `Config.log_dir`, the same and more written to TensorBoard by rank 0.

Every `Config.log_every_steps` steps rank 0 writes, over the steps since its last write:
``train/loss`` (rank 0's own loss: averaging over ranks would add a collective per step),
``train/targets_per_s`` (target elements of every worker's batches per second: words for a
language model whose targets are tokens, samples for one label per sample),
``bytes/<parameter>`` and ``bytes/total`` (what rank 0 sent and received per step,
`Runner.stats`), ``bytes/predicted_per_machine`` (the plan's Table 3 prediction for the
architecture), ``alpha/<parameter>`` and ``partitions/<parameter>`` (the plan, once α is
measured), ``phases/<phase>`` (seconds per step, `parallax.engine.diagnostics.phases`). TensorBoard
is an optional dependency (``pip install tensorboard``); without it `Config.log_dir` is refused.
"""

from __future__ import annotations

import importlib.util
import time
from typing import Any

import torch
from torch import Tensor

from parallax.errors import ConfigError

__all__ = ["MetricsLog", "Window", "require_tensorboard"]


def require_tensorboard() -> None:
    """Raise `ConfigError` saying how to install TensorBoard when it is missing (checked
    again where the writer is made: the launching host may not be a worker's)."""
    if importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(
            "Config.log_dir writes TensorBoard event files, which needs the tensorboard "
            "package on every worker: pip install tensorboard (or pip install "
            "'parallax-torch[metrics]')")


class Window:
    """Counts since the last `take`: steps, rank 0's loss, target elements, seconds, bytes
    and phase seconds (from cumulative counters)."""

    def __init__(self) -> None:
        self.steps = 0
        self.loss_sum: float | Tensor = 0.0  # a tensor where the losses are (read at `take`)
        self.losses = 0
        self.targets = 0.0
        self.began = time.perf_counter()
        self._bytes: dict[str, float] = {}
        self._phases: dict[str, float] = {}

    def add(self, loss: float | Tensor | None, targets: float | None) -> None:
        """One step: its loss (a float, or a 0-dim tensor added where it is: no device
        synchronisation per step) and target elements."""
        self.steps += 1
        if loss is not None:
            self.losses += 1
            total = self.loss_sum
            if not isinstance(loss, Tensor):
                self.loss_sum = total + loss
            elif isinstance(total, Tensor) and total.device == loss.device:
                if loss.requires_grad:  # (the sum records no graph: no no_grad() each step)
                    loss = loss.detach()
                total.add_(loss.reshape(()) if loss.ndim else loss)  # one operator a step
            else:  # the window's first tensor loss: a float64 sum of its own
                self.loss_sum = loss.detach().to(torch.float64).reshape(()) + total
        if targets is not None:
            self.targets += targets

    def take(self, bytes_total: dict[str, float], phase_seconds: dict[str, float], *,
             targets: float | None = None) -> dict[str, Any]:
        """The window's numbers (``bytes_total``/``phase_seconds``: cumulative counts now,
        restarted by `Runner.reset_stats` at any time; ``targets``: the window's target
        elements when the steps' own count does not hold them) and a new window."""
        elapsed = max(time.perf_counter() - self.began, 1e-9)
        steps = max(self.steps, 1)
        targets = self.targets if targets is None else targets
        out = {
            "steps": self.steps,
            "loss": float(self.loss_sum) / self.losses if self.losses else None,
            "targets_per_s": targets / elapsed if targets else None,
            "bytes": {name: _since(value, self._bytes.get(name, 0.0)) / steps
                      for name, value in bytes_total.items()},
            "phases": {name: _since(value, self._phases.get(name, 0.0)) / steps
                       for name, value in phase_seconds.items()},
        }
        self.steps, self.loss_sum, self.losses, self.targets = 0, 0.0, 0, 0.0
        self.began = time.perf_counter()
        self._bytes, self._phases = dict(bytes_total), dict(phase_seconds)
        return out


def _since(now: float, before: float) -> float:
    """A cumulative count's growth (a count restarted since ``before`` grew by ``now``)."""
    return now - before if now >= before else now


class MetricsLog:
    """Rank 0's TensorBoard writer (no-op elsewhere and without a log directory)."""

    def __init__(self, log_dir: str | None, *, rank: int, every: int):
        self.every = every
        self.window = Window()
        self.writer = None
        if log_dir is not None and rank == 0:
            require_tensorboard()
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=log_dir)

    def due(self, step: int) -> bool:
        return self.writer is not None and step % self.every == 0

    def write(self, step: int, numbers: dict[str, Any], plan: Any, architecture: str) -> None:
        """Write a window's ``numbers`` (`Window.take`) and the plan's, at ``step``."""
        writer = self.writer
        if writer is None:
            return
        if numbers["loss"] is not None:
            writer.add_scalar("train/loss", numbers["loss"], step)
        if numbers["targets_per_s"] is not None:
            writer.add_scalar("train/targets_per_s", numbers["targets_per_s"], step)
        for name, value in numbers["bytes"].items():
            writer.add_scalar(f"bytes/{name}", value, step)
        writer.add_scalar("bytes/total", sum(numbers["bytes"].values()), step)
        predicted = plan.predicted_total(architecture)
        if predicted is not None:
            writer.add_scalar("bytes/predicted_per_machine", predicted, step)
        for parameter in plan.parameters:
            if parameter.alpha is not None:
                writer.add_scalar(f"alpha/{parameter.name}", parameter.alpha, step)
            if parameter.partitions:
                writer.add_scalar(f"partitions/{parameter.name}", parameter.partitions, step)
        for name, seconds in numbers["phases"].items():
            writer.add_scalar(f"phases/{name}", seconds, step)
        writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
