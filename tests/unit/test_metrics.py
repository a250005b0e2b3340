"""Metrics (`parallax.metrics`): `Config.log_dir` writes TensorBoard scalars from rank 0 every
`Config.log_every_steps` steps (read back here with TensorBoard's own reader), `Runner.headline`
gives the same numbers to a progress bar, and a missing TensorBoard is refused by name."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from models import EmbeddingRegressor
from torch import nn

import parallax
from parallax.engine.diagnostics.phases import PHASES
from parallax.errors import ConfigError


def _scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


def test_rank0_writes_the_scalars_every_few_steps(single_process, tmp_path) -> None:
    torch.manual_seed(0)
    model = EmbeddingRegressor(rows=50)
    config = parallax.Config(log_dir=str(tmp_path / "tb"), log_every_steps=4,
                             sparsity_warmup_steps=2, partition_cache=None,
                             alpha_threshold=1.0)  # on the servers at one worker
    runner = parallax.get_runner(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                 nn.functional.mse_loss, config=config)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(8):
        losses.append(float(runner.step((torch.randint(50, (6, 3), generator=generator),
                                         torch.rand(6, generator=generator)))))
    parallax.shutdown()  # closes the writer
    scalars = _scalars(tmp_path / "tb")
    assert [step for step, _ in scalars["train/loss"]] == [4, 8]
    # each write is the mean of its window's losses
    for (_, value), window in zip(scalars["train/loss"], (losses[:4], losses[4:]), strict=True):
        assert value == pytest.approx(sum(window) / 4, rel=1e-6)
    assert all(value > 0 for _, value in scalars["train/targets_per_s"])
    assert {f"phases/{name}" for name in PHASES} <= set(scalars)
    assert scalars["phases/step"][0][1] > 0
    assert "alpha/embedding.weight" in scalars and "partitions/embedding.weight" in scalars
    assert scalars["partitions/embedding.weight"][-1][1] == 1
    assert "bytes/total" in scalars


def test_headline_gives_a_progress_bar_the_recent_numbers(single_process) -> None:
    torch.manual_seed(0)
    model = EmbeddingRegressor(rows=50)
    runner = parallax.get_runner(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                 nn.functional.mse_loss,
                                 config=parallax.Config(partition_cache=None))
    generator = torch.Generator().manual_seed(1)
    losses = [float(runner.step((torch.randint(50, (6, 3), generator=generator),
                                 torch.rand(6, generator=generator)))) for _ in range(3)]
    headline = runner.headline()
    assert headline["loss"] == pytest.approx(sum(losses) / 3)
    assert headline["targets_per_s"] > 0 and headline["step_s"] > 0
    assert headline["bytes_per_step"] == 0  # one worker: nothing crosses to another rank
    assert runner.headline()["loss"] is None  # a new window: no step since


def test_a_missing_tensorboard_is_refused_by_name(monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ConfigError, match="pip install tensorboard"):
        parallax.Config(log_dir="runs")


def test_a_window_sums_its_losses_in_float64_without_their_graphs() -> None:
    """Losses as tensors (with a graph, 1-element, float32) and as floats, in any order, sum
    exactly in float64 where they are, and the sum holds no graph."""
    from parallax.metrics import Window

    window = Window()
    window.add(torch.tensor(1.5, requires_grad=True) * 1, None)
    window.add(torch.tensor([2.25]), None)
    window.add(3.0, None)
    window.add(torch.tensor(1e-8, dtype=torch.float32), None)
    total = window.loss_sum
    assert isinstance(total, torch.Tensor) and total.dtype == torch.float64
    assert not total.requires_grad and window.losses == 4
    assert float(total) == 1.5 + 2.25 + 3.0 + float(torch.tensor(1e-8, dtype=torch.float32))
