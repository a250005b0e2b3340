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
from parallax.errors import CheckpointError, OptimizerError, UnsupportedProgramError


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


def _steps(model: nn.Module, optimizer: torch.optim.Optimizer, seeds: range) -> None:
    for seed in seeds:
        generator = torch.Generator().manual_seed(seed)
        ids = torch.randint(60, (8, 3), generator=generator)
        target = torch.rand(8, generator=generator, dtype=torch.float64)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(ids), target).backward()
        optimizer.step()


def _assert_close(got: object, want: object, where: str = "") -> None:
    if isinstance(want, Tensor):
        assert isinstance(got, Tensor), where
        torch.testing.assert_close(got.double(), want.double(), rtol=1e-12, atol=1e-12,
                                   msg=where)
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), where
        for key in want:
            _assert_close(got[key], want[key], f"{where}/{key}")
    else:
        assert got == want, where


@pytest.mark.parametrize("direction,optimizer", [("job-to-plain", torch.optim.Adam),
                                                 ("plain-to-job", torch.optim.Adagrad)])
def test_dcps_get_state_dict_moves_model_and_optimizer_state_between_a_job_and_a_plain_program(
        single_process, tmp_path: Path, direction: str, optimizer: type) -> None:
    """DCP's usual way in (``get_state_dict`` -> ``dcp.save``; ``dcp.load`` ->
    ``set_state_dict``) between a distributed job and a plain program, both ways: the
    receiver's next two steps equal the sender's, and the optimizer state keys are the plain
    program's names (a job's parameters carry the single-device names)."""
    from torch.distributed.checkpoint import load as dcp_load_
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    torch.manual_seed(0)
    sender_model, receiver_model = _Model().double(), _Model().double()
    sender_opt = optimizer(sender_model.parameters(), lr=0.05)
    receiver_opt = optimizer(receiver_model.parameters(), lr=0.05)
    config = parallax.Config(partition_cache=None)
    if direction == "job-to-plain":
        sender_model, sender_opt = parallax.distribute(sender_model, sender_opt, config=config)
    else:
        receiver_model, receiver_opt = parallax.distribute(receiver_model, receiver_opt,
                                                           config=config)
    _steps(sender_model, sender_opt, range(3))
    model_state, optim_state = get_state_dict(sender_model, sender_opt)
    assert set(optim_state["state"]) == {"embedding.weight", "bag.weight", "out.weight",
                                         "out.bias"}
    dcp_save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp_path / "app",
             no_dist=True)

    model_state, optim_state = get_state_dict(receiver_model, receiver_opt)
    app = {"model": model_state, "optim": optim_state}
    dcp_load_(app, checkpoint_id=tmp_path / "app", no_dist=True)
    set_state_dict(receiver_model, receiver_opt, model_state_dict=app["model"],
                   optim_state_dict=app["optim"])
    _steps(sender_model, sender_opt, range(3, 5))
    _steps(receiver_model, receiver_opt, range(3, 5))
    _assert_close(receiver_model.state_dict(), sender_model.state_dict(), "model")
    _assert_close(receiver_opt.state_dict()["state"], sender_opt.state_dict()["state"],
                  "optimizer")


def test_get_state_dict_of_a_job_whose_adam_has_no_state_yet_is_refused(
        single_process) -> None:
    """DCP fills an optimizer's empty state with a zero-lr step on gradients it writes into
    ``param.grad``, which a server-held table does not have here: refused, naming the
    parameter, rather than a template without the servers' state (whose load would then
    silently keep fresh moments)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _Model().double()
    model, opt = parallax.distribute(model, torch.optim.Adam(model.parameters(), lr=0.05),
                                     config=parallax.Config(partition_cache=None))
    with pytest.raises(UnsupportedProgramError, match="'embedding.weight' lives on the "
                                                      "parameter servers"):
        get_state_dict(model, opt)


def test_an_optimizer_state_dict_of_another_optimizer_is_refused(single_process) -> None:
    model = _Model().double()
    model, opt = parallax.distribute(model, torch.optim.Adagrad(model.parameters(), lr=0.05),
                                     config=parallax.Config(partition_cache=None))
    state = opt.state_dict()
    state["param_groups"][0]["params"] = state["param_groups"][0]["params"][:-1]
    with pytest.raises(OptimizerError, match="has 3 parameters in its param_groups, this "
                                             "optimizer 4"):
        opt.load_state_dict(state)


def test_save_dcp_writes_the_running_model(single_process, tmp_path: Path) -> None:
    """`save_dcp` of a Runner or of the model `distribute` returned: DCP reads it back equal
    to the single-device state dict (model parallelism's shards: tests/integration)."""
    from parallax.checkpoint import save_dcp

    runner, want = _trained(tmp_path / "checkpoints")
    got = load_dcp(save_dcp(runner, tmp_path / "runner-dcp"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    with pytest.raises(TypeError, match="not dict"):
        save_dcp({}, tmp_path / "nothing")
