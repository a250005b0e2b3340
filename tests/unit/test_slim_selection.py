"""Slim-DP's choices (`parallax.engine.dense_sync.slim_selection`): the core is the most
significant share, the explorer a uniform draw outside it that differs per worker and round,
and the traffic model is the paper's (2α-β)·n pushed against Plump-DP's n."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import parallax
from parallax.engine.dense_sync import slim_selection as sel

PROPERTY = settings(max_examples=80, deadline=None, derandomize=True, database=None)


@PROPERTY
@given(n=st.integers(1, 500), beta=st.just(0.0) | st.floats(0.001, 1), c=st.floats(0, 10),
       seed=st.integers(0, 2**31))
def test_core_is_the_top_of_w_plus_c_times_update(n, beta, c, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    values, update = torch.randn(n, generator=g), torch.randn(n, generator=g)
    count = sel.core_size(n, beta)
    core = sel.select_core(values, update, count, c)
    assert core.numel() == count == (min(n, max(1, round(beta * n))) if beta else 0)
    assert torch.equal(core, core.sort().values) and core.unique().numel() == count
    score = values.abs() + c * update.abs()
    chosen = torch.zeros(n, dtype=torch.bool)
    chosen[core] = True
    if 0 < count < n:  # every chosen score beats every unchosen one
        assert score[chosen].min() >= score[~chosen].max()


@PROPERTY
@given(n=st.integers(1, 400), beta=st.just(0.0) | st.floats(0.001, 1), extra=st.floats(0, 1),
       seed=st.integers(0, 2**31))
def test_explorer_is_distinct_outside_the_core_and_sized(n, beta, extra, seed) -> None:
    alpha = beta + (1 - beta) * extra
    core = sel.select_core(torch.randn(n, generator=torch.Generator().manual_seed(seed)), None,
                           sel.core_size(n, beta), 0)
    outside = sel.complement(n, core)
    assert sorted(outside.tolist() + core.tolist()) == list(range(n))
    count = sel.explorer_size(n, alpha, beta)
    explorer = sel.draw_explorer(outside, count, sel.explorer_generator(seed, 1, 2, 0))
    assert explorer.numel() == count == max(0, min(n, round(alpha * n)) - core.numel())
    assert explorer.unique().numel() == count
    assert not set(explorer.tolist()) & set(core.tolist())


def test_explorer_is_redrawn_per_worker_and_round_and_reproducible() -> None:
    outside = torch.arange(1000)
    draws = {(rank, round_): sel.draw_explorer(outside, 50, sel.explorer_generator(0, rank,
                                                                                  round_, 0))
             for rank in range(4) for round_ in range(1, 4)}
    assert len({tuple(d.tolist()) for d in draws.values()}) == len(draws)
    again = sel.draw_explorer(outside, 50, sel.explorer_generator(0, 2, 3, 0))
    assert torch.equal(again, draws[(2, 3)])


def test_explorer_draws_are_uniform() -> None:
    """Over 4000 rounds, each of 100 indices is drawn about 4000·10/100 times (binomial:
    within 5 standard deviations)."""
    outside = torch.arange(100)
    counts = torch.zeros(100)
    for round_ in range(4000):
        counts[sel.draw_explorer(outside, 10, sel.explorer_generator(0, 0, round_, 0))] += 1
    mean, std = 4000 * 0.1, (4000 * 0.1 * 0.9) ** 0.5
    assert float((counts - mean).abs().max()) < 5 * std


@pytest.mark.parametrize(("alpha", "beta"), [(0.2, 0.1), (0.3, 0.15), (1.0, 1.0), (0.5, 0.5),
                                                 (0.2, 0.0)])
def test_traffic_model_is_the_papers(alpha, beta) -> None:
    n = 10_000
    partial = sel.round_bytes(n, alpha=alpha, beta=beta, full=False, value_bytes=4, key_bytes=4)
    assert partial.push_values + partial.push_keys == round(4 * (2 * alpha - beta) * n)
    assert partial.pull_values == round(4 * alpha * n)
    full = sel.round_bytes(n, alpha=alpha, beta=beta, full=True, value_bytes=4, key_bytes=4)
    assert (full.push_values, full.push_keys, full.pull_values) == (4 * n, 0, 4 * n)
    coded = sel.round_bytes(n, alpha=alpha, beta=beta, full=False, value_bytes=4, key_bytes=4,
                            encoded=123)
    assert coded.push_values == 123 and coded.push_keys == partial.push_keys


@pytest.mark.parametrize(("options", "field"), [
    (dict(dense_sync="slim", slim=parallax.SlimDP()), None),
    (dict(dense_sync="slim", slim={"alpha": 0.5, "beta": 0.2}), None),
    (dict(dense_sync="qsgd", qsgd={"bits": 4}), None),
    (dict(dense_sync="slim", architecture="ps"), "dense_sync"),
    (dict(dense_sync="qsgd", architecture="optps"), "dense_sync"),
    (dict(dense_sync="plump", clip_grad_norm=1.0), "clip_grad_norm"),
    (dict(dense_sync="slim", checkpoint_dir="ckpt"), "checkpoint_dir"),
    (dict(qsgd=parallax.QSGD()), "qsgd"),
    (dict(dense_sync="slim", slim={"alpha": 0.5, "betta": 0.2}), "slim"),
])
def test_config_accepts_the_dense_sync_options_or_names_the_field(options, field) -> None:
    if field is None:
        config = parallax.Config(**options)
        assert parallax.Config.from_dict(config.to_dict()) == config
        if config.dense_sync == "qsgd":
            assert config.qsgd == parallax.QSGD(bits=4)
        return
    with pytest.raises(parallax.ConfigError, match=rf"^Config\.{field} must be"):
        parallax.Config(**options)


@pytest.mark.parametrize(("make", "field"), [
    (lambda: parallax.SlimDP(alpha=0.1, beta=0.2), "slim.alpha"),
    (lambda: parallax.SlimDP(beta=-0.1), "slim.beta"),
    (lambda: parallax.SlimDP(reselect_every=0), "slim.reselect_every"),
    (lambda: parallax.SlimDP(sync_every=1.5), "slim.sync_every"),
    (lambda: parallax.SlimDP(significance=-1), "slim.significance"),
    (lambda: parallax.QSGD(bits=3), "qsgd.bits"),
    (lambda: parallax.QSGD(bucket_size=0), "qsgd.bucket_size"),
])
def test_bad_options_name_their_field(make, field) -> None:
    with pytest.raises(parallax.ConfigError, match=rf"^Config\.{field} must be"):
        make()
