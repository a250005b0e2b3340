"""`parallax.global_mean` in one process: a plain program's mean, one worker's mean (its
gradient too), and its argument checks. Several workers: tests/habits.py's ``global_mean``
(exact on 2 workers where a per-worker mean is not: ``ignore_index_mean``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import parallax


def _loss(model: nn.Module, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(ids), target, ignore_index=-1, reduction="sum")


def test_without_a_run_it_is_the_sum_over_the_count() -> None:
    total = torch.tensor(6.0, dtype=torch.float64, requires_grad=True)
    mean = parallax.global_mean(total, torch.tensor(4))
    mean.backward()
    assert mean.item() == 1.5 and total.grad.item() == 0.25
    assert parallax.global_mean(torch.tensor([3.0]), 2.0).item() == 1.5


def test_one_worker_gives_one_devices_mean_and_gradient(single_process) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(6, 3), nn.Linear(3, 4)).double()
    reference = nn.Sequential(nn.Embedding(6, 3), nn.Linear(3, 4)).double()
    reference.load_state_dict(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    dmodel, doptimizer = parallax.distribute(
        model, optimizer, config=parallax.Config(partition_cache=None, alpha_threshold=1.0))
    ids, target = torch.tensor([0, 2, 4, 5]), torch.tensor([1, -1, 3, -1])
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    for _ in range(2):
        doptimizer.zero_grad()
        mean = parallax.global_mean(_loss(dmodel, ids, target), (target != -1).sum())
        mean.backward()
        doptimizer.step()
        ref_optimizer.zero_grad()
        want = nn.functional.cross_entropy(reference(ids), target, ignore_index=-1)
        want.backward()
        ref_optimizer.step()
        assert mean.item() == pytest.approx(want.item(), rel=1e-12)
    for name, value in reference.state_dict().items():
        assert torch.allclose(dmodel.state_dict()[name], value, rtol=0, atol=1e-12), name


@pytest.mark.parametrize(("total", "count", "error", "words"), [
    (3.0, 2, parallax.ArgumentTypeError, "total must be a tensor"),
    (torch.ones(2), 2, parallax.ArgumentError, "total must hold one value.*got shape (2,)"),
    (torch.tensor(1.0), True, parallax.ArgumentTypeError, "count must be a number"),
    (torch.tensor(1.0), "3", parallax.ArgumentTypeError, "got str"),
    (torch.tensor(1.0), torch.ones(3), parallax.ArgumentError, "count must hold one value"),
])
def test_arguments_are_checked(total, count, error, words: str) -> None:
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        parallax.global_mean(total, count)
