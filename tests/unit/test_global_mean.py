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


def _said(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "global_mean" in r.getMessage()]


def test_a_loss_module_averaging_over_each_workers_count_is_named_once(caplog) -> None:
    from parallax.model.exactness import PerWorkerMean

    padded = torch.tensor([1, 0, -100, 2])
    assert not PerWorkerMean(nn.CrossEntropyLoss(), 1).check(padded)  # one worker: exact
    assert not PerWorkerMean(nn.CrossEntropyLoss(reduction="sum"), 2).check(padded)
    assert not PerWorkerMean(nn.MSELoss(), 2).check(padded)
    weighted = PerWorkerMean(nn.CrossEntropyLoss(weight=torch.ones(3)), 2)
    assert not weighted.check(torch.rand(4, 3))  # soft labels: divided by the batch's size
    assert weighted.check(torch.tensor([0, 1])) and not weighted.check(torch.tensor([0, 1]))
    ignoring = PerWorkerMean(nn.NLLLoss(ignore_index=0), 2)
    assert not ignoring.check(torch.tensor([1, 2])) and ignoring.check(padded)
    said = _said(caplog)
    assert len(said) == 2 and "class weights" in said[0]
    assert "NLLLoss(reduction='mean')" in said[1] and "ignore_index=0" in said[1]
    later = PerWorkerMean(nn.CrossEntropyLoss(), 2)  # only the first steps are looked at
    assert not any(later.check(torch.tensor([1, 2])) for _ in range(PerWorkerMean.STEPS))
    assert later.loss is None and not later.check(padded)


def test_get_runner_looks_at_the_targets_of_its_steps(single_process, caplog) -> None:
    from parallax.model.exactness import PerWorkerMean

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(6, 3), nn.Linear(3, 4)).double()
    loss_fn = nn.CrossEntropyLoss(ignore_index=-1)
    runner = parallax.get_runner(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn,
                                 config=parallax.Config(partition_cache=None))
    runner._per_worker_mean = PerWorkerMean(loss_fn, 2)  # as on the first of two workers
    runner.step((torch.tensor([0, 1]), torch.tensor([1, 2])))
    assert _said(caplog) == []
    runner.step((torch.tensor([0, 1]), torch.tensor([1, -1])))
    assert len(_said(caplog)) == 1
