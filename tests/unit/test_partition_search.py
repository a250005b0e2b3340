"""The partition-count search (issue 5, part 3) against known curves, with an injected timer."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parallax.partitions.search import Sample, fit_cost_model, search_partitions, time_steps


def curve(t0: float, t1: float, t2: float):
    return lambda p: t0 + t1 / p + t2 * p


def recorder(measure):
    calls = []

    def timed(p: int) -> float:
        calls.append(p)
        return measure(p)

    return timed, calls


def test_convex_curve_doubles_past_the_optimum_then_fits_it() -> None:
    # t(P) = 1 + 64/P + P: minimum at P = 8
    timed, calls = recorder(curve(1.0, 64.0, 1.0))
    result = search_partitions(timed, start=2, max_partitions=1024)
    assert calls == [2, 4, 8, 16, 1]  # double while faster, then halve from the start once
    assert result.partitions == 8
    assert result.theta == pytest.approx((1.0, 64.0, 1.0))
    assert len(result.samples) <= 6


def test_optimum_below_the_start_is_found_by_halving() -> None:
    # minimum at P = 2 (t1 = 4, t2 = 1), start at 16 servers
    timed, calls = recorder(curve(0.5, 4.0, 1.0))
    result = search_partitions(timed, start=16, max_partitions=1024)
    assert calls == [16, 32, 8, 4, 2, 1]
    assert result.partitions == 2


def test_fitted_minimum_between_samples_is_an_integer_inside_the_range() -> None:
    # minimum of 1 + 50/P + P is at sqrt(50) ≈ 7.07: between the samples 4 and 8
    result = search_partitions(curve(1.0, 50.0, 1.0), start=1, max_partitions=64)
    assert [s.partitions for s in result.samples] == [1, 2, 4, 8, 16]
    assert result.partitions == 7


def test_monotone_decreasing_curve_stops_at_the_maximum() -> None:
    timed, calls = recorder(curve(1.0, 100.0, 0.0))
    result = search_partitions(timed, start=4, max_partitions=32)
    assert calls == [4, 8, 16, 32, 2]
    assert result.partitions == 32


def test_monotone_increasing_curve_goes_to_one_partition() -> None:
    result = search_partitions(curve(1.0, 0.0, 0.5), start=4, max_partitions=32)
    assert [s.partitions for s in result.samples] == [4, 8, 2, 1]
    assert result.partitions == 1


def test_a_single_possible_count_is_one_sample_and_no_fit() -> None:
    timed, calls = recorder(curve(1.0, 1.0, 1.0))
    result = search_partitions(timed, start=1, max_partitions=1)
    assert calls == [1] and result.partitions == 1 and result.theta is None


def test_two_samples_choose_the_faster_without_a_fit() -> None:
    result = search_partitions(curve(0.0, 10.0, 0.0), start=1, max_partitions=2)
    assert result.theta is None and result.partitions == 2


def test_noisy_convex_curve_lands_near_the_true_optimum() -> None:
    rng = np.random.default_rng(0)
    true = curve(2.0, 128.0, 2.0)  # minimum at P = 8, t = 34
    result = search_partitions(lambda p: true(p) * (1 + 0.03 * rng.standard_normal()),
                               start=2, max_partitions=256)
    assert true(result.partitions) <= 1.06 * true(8)  # the papers' bar: within 6 %


def test_start_outside_the_bounds_is_refused() -> None:
    with pytest.raises(ValueError, match="start=8"):
        search_partitions(curve(1, 1, 1), start=8, max_partitions=4)


@settings(max_examples=200, deadline=None)
@given(t0=st.floats(0.0, 10.0), t1=st.floats(0.01, 1000.0), t2=st.floats(0.001, 10.0),
       start=st.sampled_from([1, 2, 4, 8]))
def test_exact_convex_curves_are_solved_within_the_sampled_range(t0, t1, t2, start) -> None:
    t = curve(t0, t1, t2)
    result = search_partitions(t, start=start, max_partitions=4096)
    sampled = [s.partitions for s in result.samples]
    assert min(sampled) <= result.partitions <= max(sampled)
    best = min(range(min(sampled), max(sampled) + 1), key=t)
    assert t(result.partitions) <= t(best) * (1 + 1e-6) + 1e-9
    assert len(sampled) <= 14


def test_fit_recovers_the_parameters() -> None:
    samples = [Sample(p, 3.0 + 12.0 / p + 0.5 * p) for p in (1, 2, 4, 8)]
    assert fit_cost_model(samples) == pytest.approx((3.0, 12.0, 0.5))


def test_time_steps_discards_the_first_half() -> None:
    ticks = iter([0, 10, 10, 15, 15, 16, 16, 17])  # step durations 10, 5, 1, 1
    calls = []
    assert time_steps(lambda: calls.append(1), 4, clock=lambda: next(ticks)) == 1.0
    assert len(calls) == 4
    with pytest.raises(ValueError, match="at least 2"):
        time_steps(lambda: None, 1)


def _trains_as_one_device(optimizer: type, config: object, steps: int, *,
                          move: Callable[[object], None],
                          after: Callable[[object], None] = lambda runner: None) -> None:
    """An embedding and a linear layer trained by a runner under ``config`` beside the same
    program on one device (``optimizer``, lr 0.1, ``steps`` steps), ``move(runner)`` after
    the third step and ``after(runner)`` at the end: the parameters must agree."""
    import torch
    from torch import nn

    import parallax

    torch.manual_seed(0)
    reference = nn.Sequential(nn.Embedding(30, 4), nn.Flatten(), nn.Linear(8, 1))
    model = nn.Sequential(nn.Embedding(30, 4), nn.Flatten(), nn.Linear(8, 1))
    model.load_state_dict(reference.state_dict())
    runner = parallax.get_runner(model, optimizer(model.parameters(), lr=0.1),
                                 nn.functional.mse_loss, config=config)
    try:
        one_device = optimizer(reference.parameters(), lr=0.1)
        generator = torch.Generator().manual_seed(1)
        for step in range(steps):
            ids, target = torch.randint(30, (5, 2), generator=generator), torch.rand(5, 1)
            runner.step((ids, target))
            one_device.zero_grad()
            nn.functional.mse_loss(reference(ids), target).backward()
            one_device.step()
            if step == 2:
                move(runner)
        after(runner)
        trained = runner.state_dict()
    finally:
        parallax.shutdown()
    for name, value in reference.state_dict().items():  # (on CUDA where the runner is)
        torch.testing.assert_close(trained[name].cpu(), value, msg=name)


def test_repartition_in_process_keeps_training_and_checks_its_argument() -> None:
    import torch

    import parallax

    def checked(runner) -> None:  # type: ignore[no-untyped-def]
        assert [p.partitions for p in runner.plan.parameters if p.sparse] == [7]
        with pytest.raises(ValueError, match=r"'0.weight'.*\[1, 30\]"):
            runner.repartition(31)

    # (alpha_threshold=1.0: the table stays on the servers)
    _trains_as_one_device(torch.optim.Adam, parallax.Config(alpha_threshold=1.0), 6,
                          move=lambda runner: runner.repartition(7), after=checked)


def test_a_moved_table_holds_no_gradient_while_its_rows_are_read(monkeypatch) -> None:
    """Moving a table (here 3 -> 2 partitions, Adagrad) frees its old partitions' gradient
    before reading the rows (the moved table starts without one: it is memory the move's
    peak need not hold), and training goes on as one device's."""
    import torch

    import parallax
    from parallax.partitions import repartition

    held_while_read = []
    read = repartition._read_in_rounds

    def spied(table, *args, **kwargs):  # type: ignore[no-untyped-def]
        held_while_read.append([p.grad is not None for p in (table.shard, *table.parts)])
        return read(table, *args, **kwargs)

    def moved(runner) -> None:  # type: ignore[no-untyped-def]
        held_while_read.clear()
        runner.repartition(2)
        assert held_while_read and not any(map(any, held_while_read))

    monkeypatch.setattr(repartition, "_read_in_rounds", spied)
    _trains_as_one_device(torch.optim.Adagrad,
                          parallax.Config(alpha_threshold=1.0, num_partitions=3), 5, move=moved)


@pytest.mark.parametrize("optimizer_name, before, after", [("Adagrad", 3, 2), ("Adam", 1, 2)])
def test_a_moved_table_frees_its_old_rows_and_state_as_soon_as_they_are_read(
        monkeypatch, optimizer_name: str, before: int, after: int) -> None:
    """The old shard's memory goes once its rows are read, before the optimizer state is
    (the new owner never holds the old rows, the whole table and its state at once); the
    old per-row state (Adagrad's sums, Adam's two moments) once it is read; training goes on
    as one device's."""
    import torch

    import parallax
    from parallax.partitions import repartition

    old: dict[str, list] = {}
    shard_bytes_while_state_read = []
    read = repartition._read_in_rounds

    def spied(table, ids, source=None, **kwargs):  # type: ignore[no-untyped-def]
        if source is not None:
            shard_bytes_while_state_read.append(
                [p.untyped_storage().nbytes() for p in old["shard"]])
        return read(table, ids, source, **kwargs)

    def moved(runner) -> None:  # type: ignore[no-untyped-def]
        (table,) = [t for t in runner.tables.values() if hasattr(t, "shard")]
        old["shard"] = [table.shard, *table.parts]  # (the partitions view the shard)
        old["state"] = runner.shard_optimizer.per_row_state(table)
        assert len(old["state"]) == before * (1 if optimizer_name == "Adagrad" else 2)
        runner.repartition(after)
        assert shard_bytes_while_state_read and not any(map(any, shard_bytes_while_state_read))
        assert [s.untyped_storage().nbytes() for s in old["state"]] == [0] * len(old["state"])

    monkeypatch.setattr(repartition, "_read_in_rounds", spied)
    _trains_as_one_device(getattr(torch.optim, optimizer_name), parallax.Config(
        alpha_threshold=1.0, num_partitions=before), 6, move=moved)


def test_balanced_choice_keeps_every_server_equally_loaded() -> None:
    # t(P) = 1 + 36/P + P: minimum at P = 6, which 4 servers cannot share evenly
    timed, calls = recorder(curve(1.0, 36.0, 1.0))
    assert search_partitions(timed, start=4, max_partitions=64).partitions == 6
    balanced = search_partitions(curve(1.0, 36.0, 1.0), start=4, max_partitions=64, balance=4)
    assert [s.partitions for s in balanced.samples] == [4, 8, 16, 2]
    assert balanced.partitions == 8  # t(8) = 13.5 < t(4) = 14 < t(12) = 16
    # a sampled count below the servers stays a candidate (here the best one)
    low = search_partitions(curve(0.0, 1.0, 1.0), start=4, max_partitions=64, balance=4)
    assert low.partitions == 1
