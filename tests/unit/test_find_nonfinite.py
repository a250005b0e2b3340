"""The step's finiteness check (`parallax.engine.optimizers.grad_norm.find_nonfinite`): who is
named, and one read-back for a finite step (on a GPU each read-back is a synchronisation)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from parallax.engine.optimizers.grad_norm import find_nonfinite, finite_together

READ_BACKS = ("tolist", "item", "__bool__", "__float__", "__int__")


def _check(loss: torch.Tensor, dense: list[tuple[str, torch.Tensor | None]],
           group: dist.ProcessGroup):  # type: ignore[no-untyped-def]
    return find_nonfinite(loss, {}, dense, rank=0, world=1, group=group,
                          device=torch.device("cpu"))


def test_a_finite_step_is_read_back_once(group: dist.ProcessGroup,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Loss flags, tables' norms and the dense gradients' verdict come back in one read."""
    reads: list[str] = []
    for name in READ_BACKS:
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda self, *a, _n=name, _o=original: reads.append(_n) or _o(self, *a))
    found = _check(torch.tensor(1.5), [("a", torch.ones(3)), ("b", None),
                                       ("c", torch.ones(2, 2).to_sparse())], group)
    monkeypatch.undo()
    assert not found and found.ranks == [] and found.parameters == []
    assert reads == ["tolist"]


def test_the_bad_loss_rank_and_gradients_are_named(group: dist.ProcessGroup) -> None:
    """A NaN loss names the rank; an Inf in one dense gradient names that parameter only."""
    found = _check(torch.tensor(float("nan")),
                   [("a", torch.ones(3)), ("b", torch.tensor([1.0, float("inf")]))], group)
    assert found and found.ranks == [0] and found.parameters == ["b"]
    assert found.describe() == "loss on rank(s) [0] and aggregated gradient of ['b']"
    assert not _check(torch.tensor(0.0), [("a", torch.ones(3))], group)


def test_finite_together_is_a_tensor_or_none() -> None:
    """No gradient: None; otherwise a 0-dim bool tensor, False if any value is NaN/Inf."""
    assert finite_together([None]) is None
    assert bool(finite_together([torch.ones(2), torch.zeros(1)]))
    assert not bool(finite_together([torch.ones(2), torch.tensor([float("-inf")])]))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_finite_together_finds_a_bad_value_among_any_gradients(bad: float) -> None:
    """NaN and either infinity are found in any gradient of a mixed list (dtypes, a sparse
    gradient, an empty one, a huge finite float16 that a sum would overflow)."""
    def grads(poisoned: int | None) -> list[torch.Tensor | None]:
        out: list[torch.Tensor | None] = [
            torch.full((3,), 6e4, dtype=torch.float16), torch.ones(2, 2, dtype=torch.float64),
            torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.ones(2), (4,)),
            torch.empty(0, 3), None, torch.zeros(5, dtype=torch.complex64)]
        if poisoned is not None:
            target = out[poisoned]
            assert target is not None
            (target._values() if target.is_sparse else target).view(-1)[-1] = bad
        return out

    assert bool(finite_together(grads(None)))
    for poisoned in (0, 1, 2, 5):
        assert not bool(finite_together(grads(poisoned))), poisoned
    assert bool(finite_together([torch.empty(0), None]))


def test_finite_together_leaves_every_gradient_bitwise_as_it_was() -> None:
    """The fused check multiplies by one in place: values (a negative zero, a subnormal, the
    largest float) and version counters stay as they were, and a gradient of a
    ``create_graph`` backward keeps its graph."""
    values = torch.tensor([-0.0, 5e-324, 1.7976931348623157e308, -3.25], dtype=torch.float64)
    x = torch.ones(3, requires_grad=True)
    (graph_grad,) = torch.autograd.grad((x ** 3).sum(), x, create_graph=True)
    grads = [values.clone(), torch.tensor([1e-45, -2.5]), graph_grad]
    before = [(g.detach().clone(), g._version) for g in grads]
    assert bool(finite_together(grads))
    for grad, (old, version) in zip(grads, before, strict=True):
        assert torch.equal(grad.detach().view(torch.uint8), old.view(torch.uint8))
        assert grad._version == version
    assert graph_grad.grad_fn is not None
    torch.autograd.grad(graph_grad.sum(), x)  # the second backward still runs
