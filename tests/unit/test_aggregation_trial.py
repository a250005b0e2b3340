"""The leader hop's timed trial (`parallax.step.aggregation_trial`) with an injected clock: the
hop on for a sample, off for a sample, then the faster kept; each sample the mean of its
second half. The multi-process run is tests/integration/test_traffic.py."""

from __future__ import annotations

import pytest
import torch

from parallax.config import Config
from parallax.errors import ConfigError
from parallax.step.aggregation_trial import AggregationTrial


def _run(with_hop: list[float], without: list[float]) -> tuple[AggregationTrial, list[bool]]:
    switched: list[bool] = []
    trial = AggregationTrial(switched.append, steps=len(with_hop), group=None,
                             device=torch.device("cpu"))
    trial.begin()
    for seconds in [*with_hop, *without]:
        assert trial.active
        trial.after_step(seconds)
    return trial, switched


def test_the_hop_is_dropped_when_it_is_slower() -> None:
    # the first half of each sample is discarded: 9.0 (a re-layout's slow step) does not count
    trial, switched = _run([9.0, 9.0, 0.30, 0.32], [9.0, 9.0, 0.20, 0.22])
    assert not trial.active
    assert switched == [True, False, False]
    assert trial.samples == pytest.approx({True: 0.31, False: 0.21})
    assert not trial.keeps
    assert trial.summary() == ("local aggregation off by trial: 310.0 ms/step with the leader "
                               "hop, 210.0 without")


def test_the_hop_is_kept_when_it_is_faster() -> None:
    trial, switched = _run([1.0, 0.1, 0.1, 0.1], [0.0, 0.2, 0.2, 0.2])
    assert switched == [True, False, True]
    assert trial.keeps and "kept by trial" in trial.summary()


def test_a_tie_drops_the_hop() -> None:
    # 2 % faster with the hop: inside KEEP_MARGIN (3 %), no benefit shown
    trial, switched = _run([0.245, 0.245], [0.25, 0.25])
    assert switched == [True, False, False] and not trial.keeps
    trial, switched = _run([0.24, 0.24], [0.25, 0.25])  # 4 % faster: kept
    assert trial.keeps and switched[-1] is True


def test_steps_after_the_trial_are_ignored() -> None:
    trial, switched = _run([0.1, 0.1], [0.2, 0.2])
    trial.after_step(5.0)
    assert switched == [True, False, True] and trial.samples[True] == pytest.approx(0.1)


@pytest.mark.parametrize("steps", [1, -2, 2.5])
def test_config_refuses_a_trial_of_fewer_than_two_steps(steps: object) -> None:
    with pytest.raises(ConfigError, match="local_aggregation_trial_steps"):
        Config(local_aggregation_trial_steps=steps)  # type: ignore[arg-type]
    assert Config(local_aggregation_trial_steps=0).local_aggregation_trial_steps == 0
