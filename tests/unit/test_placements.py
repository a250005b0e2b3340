"""Seed 001's operation placements moved back (`Config.after_aggregation`, `Config.id_dedup`)
in one process: each trains as the default does, and what the baseline cannot average exactly
is refused. Their traffic at 2 x 2 is tests/integration/test_traffic.py; the equivalence matrix
runs them on every cluster shape."""

from __future__ import annotations

import pytest
import torch
from models import EmbeddingRegressor
from torch import nn

import parallax
from parallax.errors import UnsupportedProgramError

PLACEMENTS = [dict(after_aggregation="workers"), dict(id_dedup="servers"),
              dict(after_aggregation="workers", id_dedup="servers")]


def _train(steps: int, *, zero_grad: bool = True, **placement: object,
           ) -> dict[str, torch.Tensor]:
    """The program's own loop after `parallax.distribute` (its tables stay on the one server
    through the warm-up: the placements act there), repeated ids and a padding row."""
    torch.manual_seed(0)
    model = EmbeddingRegressor(padding_idx=0).double()
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)
    config = parallax.Config(partition_cache=None, sparsity_warmup_steps=steps,
                             clip_grad_norm=0.5, **placement)  # type: ignore[arg-type]
    model, optimizer = parallax.distribute(model, optimizer, config=config)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(3, (4, 5), generator=generator)  # ids 0 (padding) to 2, repeated
        target = torch.rand(4, dtype=torch.float64, generator=generator)
        if zero_grad:
            optimizer.zero_grad()
        nn.functional.mse_loss(model(ids), target).backward()
        optimizer.step()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    parallax.shutdown()
    return state


@pytest.mark.parametrize("placement", PLACEMENTS, ids=lambda p: "+".join(map(str, p.values())))
def test_a_placement_moved_back_trains_as_the_default(single_process, placement) -> None:
    expected = _train(4)
    got = _train(4, **placement)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-12, msg=name)


def test_the_average_on_the_workers_refuses_gradient_kept_from_an_earlier_step(
        single_process) -> None:
    """Without zero_grad the servers' aggregate holds the last step's averaged rows: dividing
    the whole aggregate again would halve them, so the baseline refuses the program."""
    with pytest.raises(UnsupportedProgramError, match="after_aggregation='workers'.*zero_grad"):
        _train(3, zero_grad=False, after_aggregation="workers")
