"""What rides in the push (`parallax.engine.tables.riders`), on 1 machine x 2 workers: under
`Runner.step` the small dense sum and the step's verdict travel in the push's first message
(no collective of their own, no finiteness check), under the own-loop door the verdict only;
both train the single-device program, and to the same bits (the same sums in the same order)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from launching import run_worker  # noqa: E402


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("riders") / "riders.pt"
    run_worker("riders_worker.py", str(out), machines=1)
    return torch.load(out)


@pytest.mark.parametrize("door", ["step", "own loop"])
def test_equal_to_the_single_device_program(trained, door) -> None:
    for name, value in trained["single"].items():
        torch.testing.assert_close(trained[door]["state"][name], value, rtol=0, atol=1e-9,
                                   msg=f"{door}: {name}")


def test_both_doors_give_the_same_bits(trained) -> None:
    step, loop = trained["step"]["state"], trained["own loop"]["state"]
    assert step.keys() == loop.keys()
    for name in step:
        assert torch.equal(step[name], loop[name]), name


def test_runner_step_sums_the_dense_part_in_the_push(trained) -> None:
    assert trained["step"]["ridden"] == trained["steps"]
    # the user's own loop may read .grad between backward and step: DDP's hook sums there
    assert trained["own loop"]["ridden"] == 0


def test_no_finiteness_check_of_its_own_in_either_door(trained) -> None:
    assert trained["step"]["checks"] == trained["own loop"]["checks"] == 0
