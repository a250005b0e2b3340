"""Under ``architecture="allreduce"`` a replicated table is updated at its touched rows only
where a zero gradient changes nothing (plain SGD, Adagrad without weight decay): those rows are
stepped by the optimizer's own functional update and the table is hidden from its ``step()``,
the work the servers and Horovod do, and it trains as the single-device program, to the bit;
Adam (whose moments move untouched rows) keeps the dense update."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import parallax
from parallax.engine.optimizers import replica_rows


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(200, 4)
        self.out = nn.Linear(4, 1)

    def forward(self, ids: Tensor) -> Tensor:
        return self.out(self.embedding(ids).mean(dim=1)).squeeze(1)


def _batches() -> list[tuple[Tensor, Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randint(200, (6, 3), generator=generator),
             torch.rand(6, generator=generator, dtype=torch.float64)) for _ in range(4)]


def _watch_skipped(optimizer: torch.optim.Optimizer, param: nn.Parameter) -> list[bool]:
    """Whether ``param`` has no gradient (its rows stepped by the engine) at each
    ``optimizer.step()``, appended here."""
    seen: list[bool] = []
    step = optimizer.step

    def watched(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(param.grad is None)
        return step(*args, **kwargs)

    optimizer.step = watched  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize(("make", "rows_only"), [
    (lambda p: torch.optim.Adagrad(p, lr=0.1), True),
    (lambda p: torch.optim.Adagrad(p, lr=0.1, foreach=True), True),
    (lambda p: torch.optim.SGD(p, lr=0.1), True),
    (lambda p: torch.optim.Adagrad(p, lr=0.1, weight_decay=0.01), False),
    (lambda p: torch.optim.Adam(p, lr=0.01), False),
])
def test_only_the_touched_rows_are_stepped_where_that_is_exact(single_process, make,
                                                              rows_only: bool) -> None:
    torch.manual_seed(0)
    model = _Model().double()
    reference = _Model().double()
    reference.load_state_dict(model.state_dict())
    optimizer = make(model.parameters())
    seen = _watch_skipped(optimizer, model.embedding.weight)
    runner = parallax.get_runner(model, optimizer, nn.functional.mse_loss, config=parallax.Config(
        architecture="allreduce", partition_cache=None))
    plain = make(reference.parameters())
    for ids, target in _batches():
        runner.step((ids, target))
        plain.zero_grad()
        nn.functional.mse_loss(reference(ids), target).backward()
        plain.step()
    assert seen == [rows_only] * 4
    assert model.embedding.weight.grad is not None  # the dense gradient put back
    for name, value in runner.state_dict().items():
        # the dense program's arithmetic on the touched rows: the same bits
        assert torch.equal(value, reference.state_dict()[name]), name


def test_a_whole_weight_loss_term_keeps_the_dense_update(single_process) -> None:
    """A loss term on the whole table (L2 on the weight) gives every row a gradient: the
    touched rows alone would silently drop it (0.28 off after 4 steps before this was seen)."""
    torch.manual_seed(0)
    model, reference = _Model().double(), _Model().double()
    reference.load_state_dict(model.state_dict())

    def loss_of(net: nn.Module):  # type: ignore[no-untyped-def]
        return lambda out, target: (nn.functional.mse_loss(out, target)
                                    + 1e-2 * net.embedding.weight.pow(2).sum())

    runner = parallax.get_runner(model, torch.optim.Adagrad(model.parameters(), lr=0.1),
                                 loss_of(model), config=parallax.Config(
                                     architecture="allreduce", partition_cache=None))
    plain = torch.optim.Adagrad(reference.parameters(), lr=0.1)
    for ids, target in _batches():
        runner.step((ids, target))
        plain.zero_grad()
        loss_of(reference)(reference(ids), target).backward()
        plain.step()
    for name, value in runner.state_dict().items():
        torch.testing.assert_close(value, reference.state_dict()[name], rtol=1e-12, atol=1e-14)


def test_clipping_keeps_the_touched_rows_update(single_process) -> None:
    """``Config.clip_grad_norm`` scales the gradient in place (zeros stay zeros): the update
    stays the touched rows' and equals clip_grad_norm_ on one device."""
    torch.manual_seed(0)
    model, reference = _Model().double(), _Model().double()
    reference.load_state_dict(model.state_dict())
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)
    seen = _watch_skipped(optimizer, model.embedding.weight)
    runner = parallax.get_runner(model, optimizer, nn.functional.mse_loss, config=parallax.Config(
        architecture="allreduce", partition_cache=None, clip_grad_norm=0.05))
    plain = torch.optim.Adagrad(reference.parameters(), lr=0.1)
    for ids, target in _batches():
        runner.step((ids, target))
        plain.zero_grad()
        nn.functional.mse_loss(reference(ids), target).backward()
        assert nn.utils.clip_grad_norm_(reference.parameters(), 0.05) > 0.05  # it clips
        plain.step()
    assert seen == [True] * 4
    for name, value in runner.state_dict().items():
        torch.testing.assert_close(value, reference.state_dict()[name], rtol=1e-12, atol=1e-14)


def test_a_gradient_changed_in_place_is_no_longer_the_touched_rows(single_process) -> None:
    """Once ``.grad`` is not what the exchange wrote (changed in place, or replaced), its
    untouched rows are no longer known to be zero: no touched-rows update, a full check."""
    torch.manual_seed(0)
    model = _Model().double()
    runner = parallax.get_runner(model, torch.optim.Adagrad(model.parameters(), lr=0.1),
                                 nn.functional.mse_loss, config=parallax.Config(
                                     architecture="allreduce", partition_cache=None))
    runner.step(_batches()[0])
    table = runner.gradients.tables()["embedding.weight"]
    weight = model.embedding.weight
    assert table.touched_rows() is not None and weight.grad is not None
    weight.grad.add_(1.0)
    assert table.touched_rows() is None
    weight.grad = weight.grad.clone()
    assert table.touched_rows() is None


def test_the_cleared_gradient_is_reused_where_no_program_code_sees_it(single_process) -> None:
    """`Runner.step`: the next step sums into the cleared gradient (touched rows zeroed), not a
    fresh zero-filled table, and trains as one device; the own loop, whose code sees
    ``.grad``, gets a fresh tensor every step."""
    torch.manual_seed(0)
    model, reference = _Model().double(), _Model().double()
    reference.load_state_dict(model.state_dict())
    runner = parallax.get_runner(model, torch.optim.Adagrad(model.parameters(), lr=0.1),
                                 nn.functional.mse_loss, config=parallax.Config(
                                     architecture="allreduce", partition_cache=None))
    plain = torch.optim.Adagrad(reference.parameters(), lr=0.1)
    grads = []
    for ids, target in _batches():
        runner.step((ids, target))
        grads.append(model.embedding.weight.grad)
        plain.zero_grad()
        nn.functional.mse_loss(reference(ids), target).backward()
        plain.step()
        torch.testing.assert_close(grads[-1], reference.embedding.weight.grad, rtol=1e-12,
                                   atol=1e-14)
    assert all(grad is grads[0] for grad in grads)
    for name, value in runner.state_dict().items():
        torch.testing.assert_close(value, reference.state_dict()[name], rtol=1e-12, atol=1e-14)
    parallax.shutdown()

    torch.manual_seed(0)
    model = _Model().double()
    distributed, optimizer = parallax.distribute(
        model, torch.optim.Adagrad(model.parameters(), lr=0.1),
        config=parallax.Config(architecture="allreduce", partition_cache=None))
    seen = []
    for ids, target in _batches():
        optimizer.zero_grad()
        nn.functional.mse_loss(distributed(ids), target).backward()
        seen.append(model.embedding.weight.grad)
        optimizer.step()
    assert len({id(grad) for grad in seen}) == len(seen)


class _TwoLookups(_Model):
    """The same table looked up twice per step (rows shared between the two and not)."""

    def forward(self, ids: Tensor) -> Tensor:
        first = self.embedding(ids).mean(dim=1)
        second = self.embedding((ids * 7 + 3) % 200).mean(dim=1)
        return self.out(first * second).squeeze(1)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_two_lookups_a_step_update_the_union_of_their_rows(single_process, monkeypatch,
                                                           accumulate: int) -> None:
    """One worker: a table looked up twice a step (and a step of two backwards) is updated at
    the union of every lookup's rows, the single-device program's update to the bit."""
    torch.manual_seed(0)
    model, reference = _TwoLookups().double(), _TwoLookups().double()
    reference.load_state_dict(model.state_dict())
    stepped: list[int] = []  # the rows each row update stepped
    real = replica_rows.update_rows
    monkeypatch.setattr(replica_rows, "update_rows", lambda *args: (
        stepped.extend(step.rows.numel() for step in args[-1]), real(*args))[1])
    model, optimizer = parallax.distribute(
        model, torch.optim.Adagrad(model.parameters(), lr=0.1),
        config=parallax.Config(architecture="allreduce", partition_cache=None))
    plain = torch.optim.Adagrad(reference.parameters(), lr=0.1)
    for ids, target in _batches():
        for net, opt in ((model, optimizer), (reference, plain)):
            opt.zero_grad()
            for part in range(accumulate):
                rows = slice(part * 3, (part + 1) * 3) if accumulate == 2 else slice(None)
                nn.functional.mse_loss(net(ids[rows]), target[rows]).backward()
            opt.step()
    assert len(stepped) == len(_batches()) and all(0 < n < 200 for n in stepped)
    for name, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
