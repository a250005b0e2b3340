"""Gradient rows pushed while the backward runs (`Config.overlap_push`, Runner.step): the same
parameters to the bit as pushing after the backward, equal to the single-device program, and
really early: the output table's rows leave before the dense body's backward is done.

The model (tests/scripts/early_push_worker.py) reads its output table after a dense body, as an
LM's sampled softmax does, so its gradient arrives first and the input embedding's last."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from launching import run_worker  # noqa: E402

RUNS = ["hybrid-direct", "hybrid", "ps", "optps"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("early") / "early.pt"
    run_worker("early_push_worker.py", str(out))
    return torch.load(out)


@pytest.mark.parametrize("run", RUNS)
def test_same_parameters_to_the_bit_as_pushing_after_the_backward(trained, run) -> None:
    on, off = trained[f"{run}/on"]["state"], trained[f"{run}/off"]["state"]
    assert on.keys() == off.keys()
    for name in on:
        assert torch.equal(on[name], off[name]), f"{run}: {name} differs"


@pytest.mark.parametrize("run", RUNS)
def test_equal_to_the_single_device_program(trained, run) -> None:
    single = trained["single"]
    for name, value in trained[f"{run}/on"]["state"].items():
        torch.testing.assert_close(value, single[name], rtol=0, atol=1e-9, msg=name)


def test_tables_go_in_the_order_their_gradients_arrive(trained) -> None:
    for run in RUNS:
        assert trained[f"{run}/off"]["schedule"] is None  # overlap_push=False: no machinery
    # rank 0 timed the warm-up's backward: the output table first, the embedding after the
    # dense body, far enough apart to travel separately
    assert trained["hybrid-direct/on"]["schedule"] == [["softmax.weight"], ["embedding.weight"]]


def test_exchanges_leave_before_the_backward_ends(trained) -> None:
    direct = trained["hybrid-direct/on"]
    assert set(direct["sync"].values()) >= {"ps"}
    assert direct["sync"]["embedding.weight"] == direct["sync"]["softmax.weight"] == "ps"
    # every step's pull is pushed in items; after the warm-up in two exchanges. Each
    # step's final item waits for the push (it carries the step's verdict): the others
    # leave from the backward
    assert direct["items"] == 2 * 1 + (6 - 2) * 2
    assert direct["launched_early"] == direct["items"] - 6
    # ps: its dense parameters are pulled whole too, and they also leave early
    assert trained["ps/on"]["launched_early"] > 0
    # optps keeps the leader hop (machine-mates' rows are merged first): nothing early
    assert trained["optps/on"]["local_aggregation"] is True
    assert trained["optps/on"]["items"] == trained["optps/on"]["launched_early"] == 0
