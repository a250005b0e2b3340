"""Asynchronous training in one process (`Config.sync`): the configuration's refusals, what a
runner refuses under it, and one worker's asynchronous run equal to the synchronous one (one
worker: every push is the step's only one). The multi-worker behaviour is
tests/integration/test_async.py."""

from __future__ import annotations

import pytest
import torch
from models import EmbeddingRegressor
from torch import nn

import parallax
from parallax.errors import ConfigError, UnsupportedProgramError


def _runner(config: parallax.Config, **embedding: object) -> parallax.Runner:
    torch.manual_seed(0)
    model = EmbeddingRegressor(**embedding).double()
    return parallax.get_runner(model, torch.optim.Adam(model.parameters(), lr=0.1),
                               nn.functional.mse_loss, config=config)


def _train(runner: parallax.Runner, steps: int = 4) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        runner.step((torch.randint(10, (4, 3), generator=generator),
                     torch.rand(4, dtype=torch.float64, generator=generator)))
    return runner.state_dict()


@pytest.mark.parametrize(("values", "field"), [
    (dict(sync="asynchronous"), "sync"),
    (dict(sync="async"), "architecture"),  # default hybrid: async needs ps
    (dict(sync="async-sparse", architecture="ps"), "architecture"),
    (dict(max_staleness=2), "max_staleness"),  # only with an asynchronous sync
    (dict(sync="async", architecture="ps", max_staleness=-1), "max_staleness"),
    (dict(sync="async", architecture="ps", max_staleness=1.5), "max_staleness"),
    (dict(sync="async-sparse", local_aggregation=True), "local_aggregation"),
    (dict(sync="async-sparse", parallelism="model"), "parallelism"),
    (dict(sync="async-sparse", dense_sync="plump"), "dense_sync"),
    (dict(sync="async-sparse", clip_grad_norm=1.0), "clip_grad_norm"),
    # seed 001's placements moved back are baselines of synchronous aggregation
    (dict(sync="async", architecture="ps", after_aggregation="workers"), "after_aggregation"),
    (dict(sync="async-sparse", id_dedup="servers"), "id_dedup"),
    (dict(after_aggregation="worker"), "after_aggregation"),
    (dict(id_dedup=1), "id_dedup"),
    (dict(sync="async", architecture="ps", checkpoint_dir="ckpt", checkpoint_every_secs=60),
     "checkpoint_every_secs"),
])
def test_config_refuses_what_asynchronous_training_cannot_do(values, field) -> None:
    with pytest.raises(ConfigError, match=rf"^Config\.{field} must be "):
        parallax.Config(**values)


def test_config_round_trips_the_asynchronous_fields() -> None:
    config = parallax.Config(sync="async", architecture="ps", max_staleness=3,
                             clip_grad_norm=1.0)
    assert parallax.Config.from_dict(config.to_dict()) == config
    assert config.to_dict()["sync"] == "async"


@pytest.mark.parametrize("options", [dict(sync="async", architecture="ps"),
                                     dict(sync="async-sparse", max_staleness=1)])
def test_one_worker_trains_as_the_synchronous_runner(single_process, options) -> None:
    expected = _train(_runner(parallax.Config(partition_cache=None, architecture=options[
        "architecture"] if "architecture" in options else "hybrid")))
    parallax.shutdown()
    got = _train(_runner(parallax.Config(partition_cache=None, **options)))
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-12, msg=name)


def test_batch_dependent_lookups_are_refused(single_process) -> None:
    with pytest.raises(UnsupportedProgramError, match="'embedding.weight'.*max_norm"):
        _runner(parallax.Config(sync="async-sparse", partition_cache=None), max_norm=1.0)


def test_global_norm_clipping_and_repartitioning_are_refused(single_process) -> None:
    runner = _runner(parallax.Config(sync="async", architecture="ps", partition_cache=None))
    _train(runner, steps=1)
    with pytest.raises(UnsupportedProgramError, match="clips each push"):
        runner.clip_grad_norm(1.0)
    with pytest.raises(UnsupportedProgramError, match="num_partitions"):
        runner.repartition(2)


def test_clipping_scales_each_push_by_its_own_norm(single_process) -> None:
    """One worker: its push is the whole gradient, so per-push clipping is clip_grad_norm_."""
    torch.manual_seed(0)
    model = EmbeddingRegressor().double()
    reference = EmbeddingRegressor().double()
    reference.load_state_dict(model.state_dict())
    config = parallax.Config(sync="async", architecture="ps", clip_grad_norm=0.05,
                             partition_cache=None)
    runner = parallax.get_runner(model, torch.optim.SGD(model.parameters(), lr=0.5),
                                 nn.functional.mse_loss, config=config)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(10, (4, 3), generator=generator)
        targets = torch.rand(4, dtype=torch.float64, generator=generator) * 10
        runner.step((ids, targets))
        optimizer.zero_grad()
        nn.functional.mse_loss(reference(ids), targets).backward()
        norm = nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        optimizer.step()
        assert runner.last_grad_norm == pytest.approx(float(norm), rel=1e-12)
        assert norm > 0.05  # clipping acted
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(runner.state_dict()[name], value, rtol=0, atol=1e-12)


def test_a_gpu_worker_is_refused_with_the_way_out() -> None:
    from parallax.step.sync_modes import refuse_off_cpu

    config = parallax.Config(sync="async-sparse")
    refuse_off_cpu(torch.device("cpu"), config)  # the CPU path is the one that runs
    with pytest.raises(ConfigError, match=r"CPU workers only.*cuda:0.*sync='sync'"):
        refuse_off_cpu(torch.device("cuda", 0), config)
