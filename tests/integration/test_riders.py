"""What rides in the push (`parallax.engine.tables.riders`), on 1 machine x 2 workers: under
`Runner.step` the dense sum and the step's verdict travel in the push's first message (no
collective of their own, no finiteness check; a mid-sized dense sum goes scattered, each rank's
part to its rank, and one all_gather after the push), under the own-loop door the verdict
only; both train the single-device program, and to the same bits (the same sums in the same
order)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from launching import run_worker  # noqa: E402

SIZES = ["small", "mid-sized"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("riders") / "riders.pt"
    run_worker("riders_worker.py", str(out), machines=1)
    return torch.load(out)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("door", ["step", "own loop"])
def test_equal_to_the_single_device_program(trained, size, door) -> None:
    for name, value in trained[size]["single"].items():
        torch.testing.assert_close(trained[size][door]["state"][name], value, rtol=0,
                                   atol=1e-9, msg=f"{size}, {door}: {name}")


@pytest.mark.parametrize("size", SIZES)
def test_both_doors_give_the_same_bits(trained, size) -> None:
    step, loop = trained[size]["step"]["state"], trained[size]["own loop"]["state"]
    assert step.keys() == loop.keys()
    for name in step:
        assert torch.equal(step[name], loop[name]), name


@pytest.mark.parametrize("size", SIZES)
def test_runner_step_sums_the_dense_part_in_the_push(trained, size) -> None:
    assert trained[size]["step"]["ridden"] == trained["steps"]
    # the user's own loop may read .grad between backward and step: DDP's hook sums there
    assert trained[size]["own loop"]["ridden"] == 0


def test_a_mid_sized_dense_sum_goes_scattered_and_a_small_one_does_not(trained) -> None:
    assert trained["mid-sized"]["step"]["scattered"]
    assert not trained["small"]["step"]["scattered"]


@pytest.mark.parametrize("size", SIZES)
def test_no_finiteness_check_of_its_own_in_either_door(trained, size) -> None:
    assert trained[size]["step"]["checks"] == trained[size]["own loop"]["checks"] == 0
