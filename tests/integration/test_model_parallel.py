"""Model and 2-D (data x model) parallelism (`Config.parallelism`; the worker is
tests/scripts/model_parallel_worker.py), on 4 processes (grids 1x4 and 2x2) and on 2 (1x2):

- training equals the single-device program with the global batch for SGD, momentum and Adam
  (float64, 1e-9) with widths no group size divides, every layer gathered
  (``model_split="every-layer"``) as well as pairs, with clipping by the global norm, for a
  model whose embedding bag stays on the hybrid's sparse servers, and (2x2) for a layer that
  only some data replicas' rows reach (``find_unused_parameters``);
- the bytes each rank sends per step through each communicator equal the cost model's terms
  for the splits it ran (`parallax.parallelism.cost.scheme_collectives`);
- `state_dict` gives the plain single-device model, and a checkpoint saved on one grid
  resumes on another and trains on exactly; `parallax.checkpoint.save_dcp` writes the split
  weights through DCP as their shards;
- `parallax.shard` loaders give the workers of a model group the same samples, and the
  global batch stays W x b; ``"auto"`` picks a grid of the world and trains exactly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from parallax.parallelism.cost import local_elements, scheme_collectives
from parallax.parallelism.grid import Grid

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "scripts" / "model_parallel_worker.py"


def _launch(tmp_path_factory, world: int) -> dict:
    where = tmp_path_factory.mktemp(f"model_parallel_{world}")
    cmd = [sys.executable, "-m", "parallax.cli", "run", "--machines", "1",
           "--nproc-per-machine", str(world), str(WORKER), str(where / "out.pt"),
           str(where / "checkpoint")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = torch.load(where / "out.pt", weights_only=False)
    results["stderr"] = proc.stderr
    return results


@pytest.fixture(scope="module", params=[4, 2], ids=["4-processes", "2-processes"])
def trained(request, tmp_path_factory) -> dict:
    return _launch(tmp_path_factory, request.param)


def _reference(key) -> str:
    return key[1] if isinstance(key, tuple) else {"clip": "clip", "mixed": "mixed",
                                                  "routed": "routed", "resumed": "adam",
                                                  "auto": "adam", "every-layer": "adam"}[key]


def test_every_run_equals_the_single_device_program(trained) -> None:
    assert len(trained["runs"]) >= 7
    assert ("routed" in trained["runs"]) == (trained["world"] == 4)
    for key, run in trained["runs"].items():
        single = trained["single"][_reference(key)]
        assert set(run["state"]) == set(single), key
        for name, value in single.items():
            torch.testing.assert_close(run["state"][name], value, rtol=0, atol=1e-9,
                                       msg=f"{key}: {name}")


def test_the_grids_split_the_layers(trained) -> None:
    world = trained["world"]
    model = trained["runs"][("model", "sgd")]
    assert model["grid"] == (1, world)
    assert [str(s.split) for s in model["splits"]] == ["column", "row", "gathered"]
    # Config.model_split="every-layer": the report's scheme, every layer gathered
    assert [str(s.split) for s in trained["runs"]["every-layer"]["splits"]] == ["gathered"] * 3
    if world == 4:
        assert trained["runs"][("2d", "sgd")]["grid"] == (2, 2)
        assert [str(s.split) for s in trained["runs"]["mixed"]["splits"]] == ["column", "row"]


def test_clipping_was_active(trained) -> None:
    # the run's last global norm is above the threshold: clipping changed every step
    assert trained["runs"]["clip"]["last_grad_norm"] > 0.05


def _run(trained: dict, key) -> tuple[dict, Grid]:
    """The run ``key`` and its grid; skipped where this launch has no such grid."""
    if key not in trained["runs"]:
        pytest.skip("no 2-D grid on 2 processes")
    run = trained["runs"][key]
    return run, Grid(*run["grid"])


@pytest.mark.parametrize("key", [("model", "sgd"), ("model", "adam"), ("2d", "momentum"),
                                 "mixed", "every-layer"])
def test_bytes_per_communicator_equal_the_cost_model(trained, key) -> None:
    run, grid = _run(trained, key)
    for rank, measured in enumerate(run["ranks"]):
        predicted = scheme_collectives(run["splits"], grid, batch=8, itemsize=8,
                                       model_index=rank % grid.model,
                                       first_input_grad=key == "mixed")
        for communicator in ("model", "data"):
            want = sum(c.sent for c in predicted if c.communicator == communicator)
            assert measured["bytes"][communicator] == pytest.approx(want, rel=1e-12), \
                (key, rank, communicator)
        assert measured["bytes"]["model"] > 0
        if grid.data > 1:
            assert measured["bytes"]["data"] > 0
        # the runner's own counts (intra-machine here: one machine) say the same
        stats = measured["stats"]
        assert stats["activations (model group)"]["intra_sent"] == pytest.approx(
            measured["bytes"]["model"], abs=1)
        if grid.data > 1:
            assert stats["dense gradients (data group)"]["intra_sent"] == pytest.approx(
                measured["bytes"]["data"])


@pytest.mark.parametrize("key", [("model", "adam"), ("2d", "adam")])
def test_each_rank_holds_and_predicts_only_its_shards(trained, key) -> None:
    run, grid = _run(trained, key)
    for rank, measured in enumerate(run["ranks"]):
        mine = local_elements(run["splits"], grid, rank % grid.model) * 8  # float64
        memory = measured["memory"]
        assert memory.parameters == mine, (key, rank)
        assert memory.gradients == mine  # one copy: no DDP bucket beside the gradients
        assert memory.optimizer_state == 2 * mine  # Adam's two moments


def test_checkpoint_resumes_on_another_grid(trained) -> None:
    resumed = trained["runs"]["resumed"]
    assert resumed["grid"] == ((1, 4) if trained["world"] == 4 else (2, 1))
    # the first half alone is not the result (the resumed steps did train)
    first = trained["first_half"]
    assert any(not torch.equal(first[k], resumed["state"][k]) for k in first)


def test_the_split_weights_go_through_dcp_as_their_shards(trained) -> None:
    """`parallax.checkpoint.save_dcp` on the checkpointed grid: each split weight is written
    as its model group's shards (one DCP chunk per shard), the rest once, and DCP reads it
    all back whole, equal to the single-device state dict."""
    layers = {s.path for s in trained["first_splits"] if s.split != "replicated"}
    chunks = trained["first_dcp_chunks"]
    assert layers and all(chunks[f"{path}.weight"] == 2 for path in layers), chunks
    assert all(count == 1 for name, count in chunks.items()  # a split layer's bias may be
               if name.rsplit(".", 1)[0] not in layers), chunks  # split or not
    first = trained["first_half"]
    assert trained["first_dcp"].keys() == first.keys()
    for name, value in first.items():
        assert torch.equal(trained["first_dcp"][name], value), name


def test_loaders_of_a_model_group_read_the_same_samples(trained) -> None:
    if trained["loader"] is None:
        pytest.skip("the 2-D loader check runs on 4 processes")
    ranks = trained["loader"]
    assert ranks[0]["targets"] == ranks[1]["targets"]
    assert ranks[2]["targets"] == ranks[3]["targets"]
    assert sorted(ranks[0]["targets"] + ranks[2]["targets"]) == [float(i) for i in range(8)]
    assert all(r["global_batch"] == 8 for r in ranks)
    assert all(r["len"] == 3 for r in ranks)  # ceil(20 samples / 8 per step)


def test_auto_prints_its_table_and_picks_a_grid_of_the_world(trained) -> None:
    world = trained["world"]
    grid = trained["runs"]["auto"]["grid"]
    assert grid[0] * grid[1] == world
    assert "parallelism auto: global batch 8" in trained["stderr"]
    assert "<- chosen" in trained["stderr"]
