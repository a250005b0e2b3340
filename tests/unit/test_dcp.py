"""Checkpoints in and out of ``torch.distributed.checkpoint`` (DCP): a parallax checkpoint
exported as DCP loads with DCP's own tools (``dcp_to_torch_save`` into one file that plain
``torch.load`` reads into the single-device model), and a DCP checkpoint of the same model,
written by a plain program, loads into a parallax job; parallax -> DCP -> parallax is exact."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

import parallax
from parallax.checkpoint import export_dcp, load_dcp
from parallax.errors import CheckpointError


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(60, 4)
        self.bag = nn.EmbeddingBag(30, 4, mode="mean")
        self.out = nn.Linear(4, 1)

    def forward(self, ids: Tensor) -> Tensor:
        return self.out(self.embedding(ids).mean(dim=1) + self.bag(ids % 30)).squeeze(1)


def _trained(checkpoints: Path) -> tuple[parallax.Runner, dict[str, Tensor]]:
    torch.manual_seed(0)
    model = _Model().double()
    runner = parallax.get_runner(model, torch.optim.Adagrad(model.parameters(), lr=0.1),
                                 nn.functional.mse_loss,
                                 config=parallax.Config(partition_cache=None))
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        runner.step((torch.randint(60, (8, 3), generator=generator),
                     torch.rand(8, generator=generator, dtype=torch.float64)))
    runner.save(checkpoints)
    return runner, {k: v.clone() for k, v in runner.state_dict().items()}


def test_parallax_to_dcp_to_one_file_loads_into_the_plain_model(
        single_process, tmp_path: Path) -> None:
    _, want = _trained(tmp_path / "checkpoints")
    out = export_dcp(tmp_path / "checkpoints", tmp_path / "dcp")
    assert (out / ".metadata").exists() and not list(out.glob(".parallax-dcp-*"))
    dcp_to_torch_save(out, tmp_path / "model.pt")  # DCP's own tool
    plain = _Model().double()
    plain.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    for name, value in plain.state_dict().items():
        assert torch.equal(value, want[name]), name


def test_a_plain_programs_dcp_checkpoint_loads_into_a_job(single_process, tmp_path: Path) -> None:
    """And back: parallax -> DCP -> parallax, exact."""
    runner, _ = _trained(tmp_path / "checkpoints")
    torch.manual_seed(5)
    plain = _Model().double()  # other values than the job's
    dcp_save(plain.state_dict(), checkpoint_id=tmp_path / "plain-dcp", no_dist=True)
    runner.load_state_dict(load_dcp(tmp_path / "plain-dcp"))
    for name, value in runner.state_dict().items():
        assert torch.equal(value, plain.state_dict()[name]), name


def test_not_a_dcp_checkpoint_is_named(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not a DCP checkpoint"):
        load_dcp(tmp_path)


def test_the_command_line_exports_dcp(single_process, tmp_path: Path) -> None:
    _, want = _trained(tmp_path / "checkpoints")
    proc = subprocess.run([sys.executable, "-m", "parallax.cli", "export", "--format", "dcp",
                           str(tmp_path / "checkpoints"), str(tmp_path / "dcp")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "as a DCP checkpoint" in proc.stdout
    got = load_dcp(tmp_path / "dcp")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
