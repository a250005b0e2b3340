"""Resuming (`Config.resume`) from a checkpoint folder whose newest checkpoint was damaged
after it was written: the damage is found before anything loads (sizes and checksums of every
file), named in a warning, and the run goes on from the newest intact checkpoint, equal to a
run that was never interrupted."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from models import EmbeddingRegressor
from torch import nn

import parallax


def _runner(root: Path) -> parallax.Runner:
    torch.manual_seed(0)
    model = EmbeddingRegressor().double()
    config = parallax.Config(checkpoint_dir=str(root), checkpoint_every_steps=2)
    return parallax.get_runner(model, torch.optim.Adagrad(model.parameters(), lr=0.1),
                               nn.functional.mse_loss, config=config)


def _train_to(runner: parallax.Runner, steps: int) -> dict[str, torch.Tensor]:
    while runner.global_step < steps:
        generator = torch.Generator().manual_seed(runner.global_step)
        runner.step((torch.randint(10, (4, 3), generator=generator),
                     torch.rand(4, dtype=torch.float64, generator=generator)))
    return runner.state_dict()


def test_a_damaged_newest_checkpoint_is_skipped_and_training_ends_equal(
        tmp_path: Path, single_process: None, caplog) -> None:
    want = _train_to(_runner(tmp_path / "uninterrupted"), 6)
    parallax.shutdown()
    _train_to(_runner(tmp_path / "run"), 4)  # checkpoints at steps 2 and 4
    parallax.shutdown()
    newest = tmp_path / "run" / "step-000000004"
    victim = max((p for p in newest.iterdir() if p.suffix == ".pt"),
                 key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x10  # one bit, in the middle of the tensors
    victim.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        resumed = _runner(tmp_path / "run")
    assert resumed.global_step == 2
    assert f"skipping checkpoint {newest}" in caplog.text and victim.name in caplog.text
    got = _train_to(resumed, 6)
    for key in want:
        assert torch.equal(got[key], want[key]), key
