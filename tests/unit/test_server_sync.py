"""`Config.dense_sync` "plump"/"slim" in one process: what it refuses (with the reason and the
way out) and what a one-worker run gives."""

from __future__ import annotations

import pytest
import torch
from models import EmbeddingRegressor
from torch import nn

import parallax


def _runner(config: parallax.Config, make_optimizer=None) -> tuple[parallax.Runner, nn.Module]:
    torch.manual_seed(0)
    model = EmbeddingRegressor()
    optimizer = (make_optimizer or (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.5)))(
        model.parameters())
    return parallax.get_runner(model, optimizer, nn.functional.mse_loss, config=config), model


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randint(10, (4, 3), generator=g), torch.rand(4, generator=g)


@pytest.mark.parametrize("sync", ["plump", "slim"])
def test_an_optimizer_not_linear_in_the_gradient_is_refused(single_process, sync) -> None:
    config = parallax.Config(dense_sync=sync, partition_cache=None)
    with pytest.raises(parallax.UnsupportedProgramError,
                       match=rf"rank 0: dense_sync='{sync}' averages .* updated by Adam"):
        _runner(config, lambda p: torch.optim.Adam(p, lr=0.1))


def test_clipping_and_checkpoints_are_refused_by_name(single_process, tmp_path) -> None:
    runner, _ = _runner(parallax.Config(dense_sync="slim", partition_cache=None))
    runner.step(_batch(0))
    with pytest.raises(parallax.UnsupportedProgramError, match="no aggregated dense gradient"):
        runner.clip_grad_norm(1.0)
    with pytest.raises(parallax.UnsupportedProgramError, match="Runner.export writes"):
        runner.save(tmp_path)


def test_mixed_dense_dtypes_are_refused(single_process) -> None:
    torch.manual_seed(0)
    model = EmbeddingRegressor()
    model.head.bias.data = model.head.bias.data.double()
    with pytest.raises(parallax.UnsupportedProgramError, match=r"dtypes \['torch.float32', "
                                                               r"'torch.float64'\]"):
        parallax.get_runner(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            nn.functional.mse_loss,
                            config=parallax.Config(dense_sync="plump", partition_cache=None))


@pytest.mark.parametrize("sync", ["plump", "slim"])
def test_one_worker_trains_as_on_one_device(single_process, sync) -> None:
    """One worker, one server: its copy is the one-device model after every step; the
    servers' model (what is exported) catches up at each full round (Slim-DP's partial rounds
    leave the values outside the core and explorer on the worker): the 6th here."""
    runner, _ = _runner(parallax.Config(dense_sync=sync, partition_cache=None,
                                        slim=parallax.SlimDP(reselect_every=3)))
    for step in range(6):
        runner.step(_batch(step))
    trained = runner.state_dict()
    local = runner.dense.server.local_values()
    parallax.shutdown()
    torch.manual_seed(0)
    model = EmbeddingRegressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    for step in range(6):
        optimizer.zero_grad()
        ids, target = _batch(step)
        nn.functional.mse_loss(model(ids), target).backward()
        optimizer.step()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(trained[name], value, rtol=1e-6, atol=1e-7, msg=name)
    torch.testing.assert_close(local, torch.cat([p.detach().reshape(-1)
                                                 for p in model.head.parameters()]))
    assert runner.dense.server is not None and runner.dense.server.rounds == 6
    assert runner.dense_sync_seconds > 0  # the rounds are timed
    runner.reset_stats()
    assert runner.dense_sync_seconds == 0


def test_evaluate_and_export_see_the_servers_model_between_full_rounds(single_process) -> None:
    """After a partial round the worker's copy is ahead of the servers' model on the values
    it did not sync: evaluation and export use the servers' (what training produced), and the
    worker keeps its own copy for the next step."""
    runner, _ = _runner(parallax.Config(dense_sync="slim", partition_cache=None,
                                        slim=parallax.SlimDP(reselect_every=3)))
    for step in range(5):  # round 5 is partial
        runner.step(_batch(step))
    local = runner.dense.server.local_values()
    exported = runner.state_dict()
    assert not torch.allclose(torch.cat([exported["head.weight"].reshape(-1),
                                         exported["head.bias"]]), local)
    probe = _batch(99)
    evaluated = runner.evaluate([probe])
    torch.manual_seed(0)
    model = EmbeddingRegressor()
    model.load_state_dict(exported)
    with torch.no_grad():
        expected = float(nn.functional.mse_loss(model(probe[0]), probe[1]))
    assert evaluated == pytest.approx(expected, rel=1e-6)
    assert torch.equal(runner.dense.server.local_values(), local)  # its copy is back
