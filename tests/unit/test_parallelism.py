"""The parallelism pieces that need no process group: which linear layers are split and how,
the cost model's formulas, the grid, and the configuration's refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import parallax
from parallax.parallelism.cost import (
    Link,
    Prediction,
    choose_grid,
    grids_of,
    predict,
    report_bytes,
    scheme_collectives,
)
from parallax.parallelism.grid import Grid
from parallax.parallelism.splits import plan_splits


def _kinds(module: nn.Module, n: int) -> list[str]:
    return [str(s.split) for s in plan_splits(module, n)]


def test_pairs_around_elementwise_activations_split_column_then_row() -> None:
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.GELU(), nn.Linear(8, 8), nn.Tanh(),
                        nn.Linear(8, 6), nn.Linear(6, 3))
    assert _kinds(mlp, 2) == ["column", "row", "column", "row"]


def test_an_odd_layer_is_gathered_and_a_narrow_one_replicated() -> None:
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 5))
    assert _kinds(mlp, 4) == ["column", "row", "gathered"]
    narrow = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(),
                           nn.Linear(8, 3))
    assert _kinds(narrow, 4) == ["column", "row", "replicated"]
    assert _kinds(narrow, 1) == ["replicated"] * 3


def test_every_layer_split_gathers_every_wide_layer() -> None:
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    kinds = [str(s.split) for s in plan_splits(mlp, 4, pairs=False)]
    assert kinds == ["gathered", "gathered", "replicated"]


def test_model_split_is_checked_and_needs_a_split_parallelism() -> None:
    assert parallax.Config(parallelism="model", model_split="every-layer").model_split == \
        "every-layer"
    with pytest.raises(parallax.ConfigError, match="model_split.*one of"):
        parallax.Config(parallelism="model", model_split="gathered")
    with pytest.raises(parallax.ConfigError, match="model_split.*'pairs' with parallelism="):
        parallax.Config(model_split="every-layer")


def test_a_layer_before_a_non_elementwise_module_is_gathered() -> None:
    body = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 8))
    assert _kinds(body, 2) == ["gathered", "gathered"]


def test_a_shared_layer_stays_whole() -> None:
    shared = nn.Linear(6, 6)
    body = nn.Sequential(shared, nn.ReLU(), shared)
    assert _kinds(body, 2) == ["replicated"]  # one module, listed once


def test_linear_layers_outside_a_sequential_are_gathered() -> None:
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

        def forward(self, x):
            return self.b(self.a(x))

    assert _kinds(Two(), 2) == ["gathered", "gathered"]


def test_report_formulas_by_hand() -> None:
    widths, batch, p = [5, 10, 3], 4, 4
    weights = 5 * 10 + 10 + 10 * 3 + 3
    assert report_bytes("batch", widths, batch, p, 8) == pytest.approx(2 * 3 / 4 * weights * 8)
    assert report_bytes("model", widths, batch, p, 8) == pytest.approx(3 * 4 * 3 / 4 * 13 * 8)


def test_scheme_collectives_of_a_pair_and_a_gathered_layer() -> None:
    mlp = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 9), nn.Tanh(), nn.Linear(9, 6))
    splits = plan_splits(mlp, 2)
    collectives = scheme_collectives(splits, Grid(2, 2), batch=8, itemsize=4)
    rows = 4
    model = [c for c in collectives if c.communicator == "model"]
    assert [(c.kind, c.sent) for c in model] == [
        ("all_reduce", 2 * 1 / 2 * rows * 9 * 4),      # the row split's partial sums
        ("all_gather", 1 * rows * 3 * 4),              # the gathered layer's outputs
        ("all_reduce", 2 * 1 / 2 * rows * 9 * 4)]      # its input's gradient
    # model index 0 holds 4 of 7 and 3 of 6 output rows, 4 of 7 input columns of the row split
    local = (4 * 5 + 4) + (9 * 4 + 9) + (3 * 9 + 3)
    (data,) = [c for c in collectives if c.communicator == "data"]
    assert data.sent == 2 * 1 * local * 4 // 2
    assert scheme_collectives(splits, Grid(1, 1), batch=8, itemsize=4) == []


def test_the_pairing_saves_a_third_of_the_report_model_bytes() -> None:
    widths = [64] * 5  # equal widths: 2 collectives of B d per pair against 3 per layer
    mlp = nn.Sequential(*[m for i in range(4) for m in (nn.Linear(widths[i], widths[i + 1]),
                                                         nn.ReLU())])
    ours = sum(c.sent for c in scheme_collectives(plan_splits(mlp, 4), Grid(1, 4), batch=100,
                                                  itemsize=4, first_input_grad=True))
    theirs = report_bytes("model", widths, 100, 4, 4)
    assert ours == pytest.approx(theirs * 2 / 3)


def test_choose_grid_takes_the_cheapest_and_grids_cover_the_world() -> None:
    assert grids_of(4) == [Grid(4, 1), Grid(2, 2), Grid(1, 4)]
    assert grids_of(1) == [Grid(1, 1)]
    wide = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                         nn.Linear(1024, 1))
    slow = Link(alpha=1e-5, beta=1e-8)
    predictions = [predict(plan_splits(wide, g.model), g, slow, batch=8, itemsize=4,
                           compute_s=0.0) for g in grids_of(4)]
    # a 1024-wide network on a batch of 8: the weights dwarf the activations
    assert choose_grid(predictions).grid == Grid(1, 4)
    big_batch = [predict(plan_splits(wide, g.model), g, slow, batch=100_000, itemsize=4,
                         compute_s=0.0) for g in grids_of(4)]
    assert choose_grid(big_batch).grid == Grid(4, 1)
    tie = [Prediction(Grid(2, 1), 1.0, 0.0, 0, 0), Prediction(Grid(1, 2), 1.0, 0.0, 0, 0)]
    assert choose_grid(tie).grid == Grid(2, 1)


def test_grid_layout_is_row_major() -> None:
    grid = Grid(2, 3)
    assert grid.model_group_ranks(1) == [3, 4, 5]
    assert grid.data_group_ranks(2) == [2, 5]
    assert (grid.data_index(4), grid.model_index(4)) == (1, 1)
    with pytest.raises(parallax.ConfigError, match="model degree"):
        Grid(2, 0)


@pytest.mark.parametrize("options, match", [
    (dict(parallelism="tensor"), "Config.parallelism must be one of"),
    (dict(parallelism="2d"), "Config.parallelism must be .* unless Config.mesh"),
    (dict(parallelism="2d", mesh=(2, 0)), r"Config.mesh must be a \(data, model\) pair"),
    (dict(parallelism="model", mesh=(1, 2)), "Config.mesh must be None with parallelism='model'"),
    (dict(parallelism="model", architecture="ps"), "Config.architecture must be 'hybrid'"),
    (dict(parallelism="2d", mesh=(2, 2), dense_sync="qsgd"), "Config.dense_sync must be"),
])
def test_config_refuses_what_it_cannot_train(options, match) -> None:
    with pytest.raises(parallax.ConfigError, match=match):
        parallax.Config(**options)


def test_config_round_trips_through_json() -> None:
    config = parallax.Config(parallelism="2d", mesh=(2, 2))
    again = parallax.Config.from_dict({**config.to_dict(), "mesh": [2, 2]})
    assert again == config


def test_distribute_refuses_model_parallelism() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(parallax.UnsupportedProgramError, match="get_runner"):
        parallax.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            config=parallax.Config(parallelism="model"))
