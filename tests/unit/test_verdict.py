"""The step's verdict riding in the push (`parallax.engine.tables.verdict`): it says "finite"
only where the aggregated gradient provably is, and the full check decides everywhere else."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import parallax
from parallax.engine.tables.riders import alight, board
from parallax.engine.tables.verdict import VERDICT_KEY, Verdict, bound_of, largest_magnitudes
from parallax.step import gradients as step_gradients


def _verdict(*, loss: float = 1.0, stale: int = 0, bound: float = 1.0,
             reached: tuple[bool, ...] = (True, False)) -> Verdict:
    verdict = Verdict(loss=torch.tensor(loss))
    verdict.prepare(names=["a", "b"][:len(reached)], reached=reached, stale=stale,
                    bound=torch.tensor(bound, dtype=torch.float64), limit=10.0, world=3)
    return verdict


def test_every_rank_adds_the_ranks_verdicts_in_rank_order() -> None:
    verdict = _verdict()
    assert verdict.waiting is not None and verdict.waiting.shape == (3, 5)
    others = [_verdict(bound=2.0, reached=(False, True)), _verdict(bound=3.0)]
    received = torch.stack([verdict.waiting[0], *[v.waiting[0] for v in others]])
    verdict.receive(received)
    assert verdict.finite()  # 1 + 2 + 3 < 10
    assert verdict.reached().tolist() == [2.0, 1.0]


@pytest.mark.parametrize("rank_verdict", [
    {"loss": float("nan")}, {"stale": 1}, {"bound": 9.5}, {"bound": float("nan")},
    {"bound": float("inf")}])
def test_it_cannot_say_finite_for_a_bad_loss_stale_rows_or_a_large_bound(rank_verdict) -> None:
    verdict = _verdict(bound=0.5)
    bad = _verdict(**rank_verdict)
    assert verdict.waiting is not None and bad.waiting is not None
    verdict.receive(torch.stack([verdict.waiting[0], bad.waiting[0], verdict.waiting[0]]))
    assert not verdict.finite()


def test_a_loss_verdict_kept_on_the_device_is_read_by_no_one_until_summed() -> None:
    """A tensor loss verdict and the bound stay where they are (a meta device has no values
    to read: any read-back here would fail); on the CPU a bad one is not finite."""
    meta = Verdict(loss=torch.tensor(1.0, device="meta"))
    meta.prepare(names=["a"], reached=[True], stale=1, limit=1.0, world=2,
                 bound=torch.zeros((), dtype=torch.float64, device="meta"))
    assert meta.waiting is not None and meta.waiting.device.type == "meta"
    assert meta.waiting.shape == (2, 4)
    for finite in (True, False):
        verdict = Verdict(loss=torch.tensor(1.0 if finite else float("inf")))
        verdict.prepare(names=["a"], reached=[False], stale=0, limit=10.0, world=1,
                        bound=torch.tensor(1.0, dtype=torch.float64))
        assert verdict.waiting is not None
        verdict.receive(verdict.waiting)
        assert verdict.finite() is finite and verdict.reached().tolist() == [0.0]


def test_only_the_first_message_carries_it() -> None:
    verdict = _verdict()
    hop = parallax.engine.tables.exchange.Hop({"t": [1, 0, 2]}, {"t": [0, 1, 1]}, None,
                                              None)  # type: ignore[arg-type]
    carrying, payloads = board([verdict], hop, {"t": torch.zeros(3)})
    assert set(payloads) == {"t", VERDICT_KEY} and verdict.waiting is None
    assert carrying.send_counts[VERDICT_KEY] == [1, 1, 1]
    assert VERDICT_KEY in carrying.unaccounted  # not a parameter's traffic
    again, more = board([verdict], hop, {"t": torch.zeros(3)})
    assert again is hop and set(more) == {"t"}
    got = alight([verdict], {"t": torch.ones(1), VERDICT_KEY: torch.ones(3, 5)})
    assert set(got) == {"t"} and verdict.carried


class _Table(nn.Module):
    """One float32 table whose rows start at zero: the loss stays 0 while its gradient rows
    are ``scale`` each (each id once per batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(30, 4)
        nn.init.zeros_(self.embedding.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embedding(ids)


def _own_loop(monkeypatch, steps: list[list[float]], *, zero_grad: bool = True):
    """Train ``_Table`` in the own-loop door and on one device: each step one backward per
    scale; returns (full checks run, distributed weight, single-device weight, error)."""
    calls = []
    original = step_gradients.find_nonfinite
    monkeypatch.setattr(step_gradients, "find_nonfinite",
                        lambda *a, **k: calls.append(1) or original(*a, **k))
    torch.manual_seed(0)
    model, reference = _Table(), _Table()
    distributed, optimizer = parallax.distribute(
        model, torch.optim.SGD(model.parameters(), lr=1.0),
        config=parallax.Config(partition_cache=None))
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=1.0)
    ids = torch.arange(6)
    error = None
    try:
        for scales in steps:
            for net, opt in ((distributed, optimizer), (reference, reference_optimizer)):
                if zero_grad:
                    opt.zero_grad()
                for scale in scales:
                    (net(ids) * scale).sum().backward()
                opt.step()
    except FloatingPointError as caught:
        error = caught
    return (len(calls), distributed.state_dict()["embedding.weight"],
            reference.embedding.weight.detach(), error)


def test_a_finite_step_needs_no_check_of_its_own(monkeypatch, single_process) -> None:
    checks, weight, single, error = _own_loop(monkeypatch, [[1.0], [1e38], [2.0, 3.0]])
    assert error is None and checks == 0
    torch.testing.assert_close(weight, single, rtol=0, atol=0)


def test_rows_too_large_to_prove_finite_go_to_the_full_check(monkeypatch,
                                                             single_process) -> None:
    # 2e38 is over half of float32's largest value: the bound cannot prove the sum finite,
    # the full check finds it finite, the step applies as on one device
    checks, weight, single, error = _own_loop(monkeypatch, [[2e38]])
    assert error is None and checks == 1
    torch.testing.assert_close(weight, single, rtol=0, atol=0)


def test_finite_rows_whose_sum_overflows_are_refused_like_one_device(monkeypatch,
                                                                     single_process) -> None:
    # two backwards of finite 2e38 rows: the servers' sum is infinite, as one device's .grad
    checks, _, single, error = _own_loop(monkeypatch, [[1.0], [2e38, 2e38]])
    assert checks == 1 and error is not None
    assert "aggregated gradient of ['embedding.weight']" in str(error)


def test_gradient_kept_from_an_earlier_step_goes_to_the_full_check(monkeypatch,
                                                                   single_process) -> None:
    # no zero_grad: the servers' gradient still holds the last step's rows, which the
    # verdict's bound does not cover
    checks, weight, single, error = _own_loop(monkeypatch, [[1.0], [1.0], [1.0]],
                                              zero_grad=False)
    assert error is None and checks == 2
    torch.testing.assert_close(weight, single, rtol=0, atol=0)


def test_the_bound_is_the_sum_of_the_largest_magnitudes_and_keeps_bad_values() -> None:
    """`bound_of`: the float64 sum of each gradient's largest magnitude (empty ones add
    nothing; float16 maxima widened before the sum, which would overflow in float16); NaN and
    infinities in any gradient make it non-finite."""
    grads = [torch.tensor([[-3.0, 1.0]]), torch.full((2,), 6e4, dtype=torch.float16),
             torch.empty(0, 2), torch.tensor([0.5, -0.25], dtype=torch.float64)]
    bound = bound_of(grads)
    assert bound.dtype == torch.float64 and bound.item() == 3.0 + 60000.0 + 0.5
    assert bound_of([]).item() == 0.0 and bound_of([torch.empty(0)]).item() == 0.0
    for bad in (float("nan"), float("inf"), float("-inf")):
        poisoned = [g.clone() for g in grads]
        poisoned[1][0] = bad
        assert not torch.isfinite(bound_of(poisoned))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_largest_magnitudes_on_the_cpu_are_the_infinity_norms(dtype) -> None:
    """The CPU's `aminmax` route gives what torch's infinity norm gives, value for value
    (signed zeros, subnormals, NaN and infinities anywhere, one value, empty left out)."""
    generator = torch.Generator().manual_seed(7)
    tensors = [torch.randn(shape, generator=generator).to(dtype) * scale
               for shape, scale in (((3, 5), 1.0), ((1,), -2.0), ((0, 4), 1.0), ((64,), 1e-40),
                                    ((2, 2, 3), 1e4))]
    tensors.append(torch.tensor([-0.0, 0.0], dtype=dtype))
    tensors.append(-tensors[0].abs())  # the largest magnitude at the minimum
    for bad in (float("nan"), float("inf"), float("-inf")):
        poisoned = tensors[0].clone()
        poisoned.view(-1)[4] = bad
        tensors.append(poisoned)
    got = largest_magnitudes(tensors)
    expected = torch._foreach_norm([t for t in tensors if t.numel()], math.inf)
    assert len(got) == len(expected) == len(tensors) - 1
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == e.dtype == dtype and g.shape == ()
        assert torch.equal(g, e) or (g.isnan() and e.isnan()), (g, e)


@pytest.mark.parametrize("value", [1.5, float("nan"), float("inf"), float("-inf")])
def test_a_verdict_given_the_loss_checks_it_only_when_prepared(value: float) -> None:
    """``Verdict(loss=...)`` leaves the loss alone until a push prepares the verdict; then a
    NaN or infinite loss makes the step not provably finite."""
    verdict = Verdict(loss=torch.tensor(value, dtype=torch.float64))
    assert verdict.waiting is None
    verdict.prepare(names=["a"], reached=[True], stale=0, limit=10.0, world=1,
                    bound=torch.tensor(1.0, dtype=torch.float64))
    assert verdict.waiting is not None
    verdict.receive(verdict.waiting)
    assert verdict.finite() == math.isfinite(value)


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_ranks_rows_are_added_in_rank_order_bit_for_bit(world: int) -> None:
    from parallax.engine.tables.riders import rank_order_sum

    generator = torch.Generator().manual_seed(world)
    # magnitudes far apart: another order of the additions rounds differently
    received = torch.randn(world, 64, generator=generator, dtype=torch.float32) * torch.tensor(
        [10.0 ** (3 * (r % 3)) for r in range(world)]).unsqueeze(1)
    expected = received[0].clone()
    for rank in range(1, world):
        expected = expected + received[rank]
    total = rank_order_sum(received)
    assert torch.equal(total, expected)
    assert total.data_ptr() != received.data_ptr()  # a sum of its own, not a view of a row
