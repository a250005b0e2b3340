"""Many runs in one process (a sweep, a notebook cell run again, pretraining then
fine-tuning): each program trained after others in the same processes equals the same program
on one device, as it does trained alone (tests/scripts/runs_worker.py: both doors, a
checkpoint saved and resumed by a later program, model parallelism, asynchronous training
with max_staleness=0, a program run twice). On
26b56e5 the resume took an earlier program's loader position and trained apart silently."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from equivalence_cases import clip_like_parallax, loss_fn
from launching import run_worker
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "scripts"))
import checkpoint_worker  # noqa: E402
import runs_worker  # noqa: E402

pytestmark = pytest.mark.integration


def one_device(build, data, steps: int, loss=loss_fn, clip: float | None = None) -> dict:
    """The single-device program: ``steps`` global batches of the data set, in order."""
    model, optimizer = build()
    inputs, targets = data.tensors
    batch = checkpoint_worker.GLOBAL_BATCH
    for k in range(steps):
        optimizer.zero_grad()
        loss(model(inputs[k * batch:(k + 1) * batch]), targets[k * batch:(k + 1) * batch]
             ).backward()
        if clip is not None:
            clip_like_parallax(list(model.parameters()), clip)
        optimizer.step()
    return model.state_dict()


def _mlp_program() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = runs_worker.mlp()
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


WANT = {
    "runner": lambda: one_device(checkpoint_worker.build, checkpoint_worker.dataset(), 5,
                                 clip=0.05),
    "allreduce": lambda: one_device(lambda: checkpoint_worker.build("momentum"),
                                    checkpoint_worker.dataset(), 4),
    "save": lambda: one_device(checkpoint_worker.build, checkpoint_worker.dataset(), 3),
    "resume": lambda: one_device(checkpoint_worker.build, checkpoint_worker.dataset(), 6),
    "model": lambda: one_device(_mlp_program, runs_worker.mlp_data(), 4,
                                loss=nn.functional.mse_loss),
    "async": lambda: one_device(checkpoint_worker.build, checkpoint_worker.dataset(), 4),
}
WANT["runner-again"] = WANT["runner"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """The programs on 2 machines x 2 workers (on 1 x 2, tests/scripts/habits_worker.py
    trains some twenty programs one after another in one process, each equal to one
    device)."""
    out = tmp_path_factory.mktemp("runs-2x2")
    run_worker("runs_worker.py", str(out), machines=2, nproc_per_machine=2)
    return out


@pytest.mark.parametrize("program", list(WANT))
def test_each_program_of_the_process_equals_one_device(trained: Path, program: str) -> None:
    got, want = torch.load(trained / f"{program}.pt"), WANT[program]()
    assert got.keys() == want.keys()
    for name, value in want.items():
        difference = float((got[name] - value).abs().max() / value.abs().max())
        assert difference < 1e-9, (program, name, difference)
