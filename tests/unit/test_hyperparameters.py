"""`parallax.step.hyperparameters`: the optimizers' settings' fingerprint, the same in every
process for the same settings (2 workers that differ: tests/habits.py ``lr_per_worker``)."""

from __future__ import annotations

import subprocess
import sys

import torch

from parallax.step.hyperparameters import fingerprint, settings


def _optimizer(lr: float | torch.Tensor = 0.1) -> torch.optim.Optimizer:
    return torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=lr, betas=(0.9, 0.99))


def test_the_fingerprint_follows_the_settings_and_not_the_process() -> None:
    here = fingerprint([_optimizer()])
    assert here == fingerprint([_optimizer()]) and here == int(here)
    assert here != fingerprint([_optimizer(0.2)])
    changed = _optimizer()
    changed.param_groups[0]["betas"] = (0.8, 0.99)
    assert here != fingerprint([changed])
    assert dict(settings([_optimizer(torch.tensor(0.5))])[0])["lr"] == 0.5
    code = ("from parallax.step.hyperparameters import fingerprint; import torch; print("
            "fingerprint([torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=0.1, "
            "betas=(0.9, 0.99))]))")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env={"PYTHONHASHSEED": "123", "PATH": ""}).stdout
    assert float(other) == here  # another process, another string hash salt


def test_the_first_differing_setting_is_named_over_every_ranks_keys() -> None:
    from parallax.step.hyperparameters import _first_difference

    assert _first_difference([[[("lr", 0.05)]], [[("lr", 0.1)]]]) == (
        "param group 0's 'lr' differs: rank 0 0.05, rank 1 0.1")
    assert _first_difference([[[("lr", 0.05)]], [[("lr", 0.05), ("x", 2)]]]) == (
        "param group 0's 'x' differs: rank 0 None, rank 1 2")  # a key rank 0 lacks
    assert "numbers of param groups" in _first_difference([[[("lr", 1)]], [[("lr", 1)]] * 2])


def test_the_settings_rider_sends_one_row_per_peer_and_compares_every_ranks() -> None:
    from parallax.step.hyperparameters import SettingsRider

    rider = SettingsRider([_optimizer()], world=3, device=torch.device("cpu"))
    assert rider.waiting is not None and rider.waiting.shape == (3, 1)
    assert rider.waiting.dtype == torch.float64
    assert (rider.waiting == fingerprint([_optimizer()])).all()
    assert not rider.differs()  # nothing received yet: the push raised before it came
    same = rider.waiting.clone()
    rider.receive(same)
    assert not rider.differs()
    other = same.clone()
    other[2, 0] = fingerprint([_optimizer(0.2)])
    rider.receive(other)
    assert rider.differs()
