"""Ids read ahead of the forward: which models get an id program, and what it saves.

Equivalence with look-ahead on (models whose ids are inputs) and off (untraceable models) is
covered by the equivalence suite; here: the program itself and the collectives it saves.
"""

from __future__ import annotations

import sys

import pytest
import torch
from equivalence_cases import Mixed
from torch import Tensor, nn

import parallax
from parallax.engine.tables import exchange


class ThreeTables(nn.Module):
    """A recommender-shaped model: three tables read by the inputs (one hashed), an MLP."""

    def __init__(self, ids_from_inputs: bool = True):
        super().__init__()
        self.users = nn.Embedding(50, 4)
        self.items = nn.EmbeddingBag(60, 4, mode="sum")
        self.genres = nn.Embedding(20, 4)
        self.head = nn.Linear(12, 1)
        self.ids_from_inputs = ids_from_inputs

    def forward(self, users: Tensor, items: Tensor, genres: Tensor) -> Tensor:
        if not self.ids_from_inputs:  # ids that depend on a parameter: no look-ahead
            users = users + (self.head.bias > 1e9).long()
        u = self.users(users.view(-1))
        i = self.items(items % 60)
        g = self.genres(genres).mean(dim=1)
        return self.head(torch.cat([u, i, g], dim=1)).squeeze(1)


def _batch(generator: torch.Generator) -> tuple[tuple[Tensor, Tensor, Tensor], Tensor]:
    users = torch.randint(50, (8, 1), generator=generator)
    items = torch.randint(120, (8, 3), generator=generator)
    genres = torch.randint(20, (8, 2), generator=generator)
    return (users, items, genres), torch.rand(8, generator=generator)


def _runner(model: nn.Module) -> parallax.Runner:
    return parallax.get_runner(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               nn.functional.mse_loss)


def test_ids_of_inputs_and_their_reshapes_get_a_program(single_process) -> None:
    runner = _runner(ThreeTables())
    program = runner.forward_pass.id_program
    assert program is not None
    (users, items, genres), _ = _batch(torch.Generator().manual_seed(0))
    got = program(users, items, genres)
    assert [call.path for call in got] == ["users", "items", "genres"]
    torch.testing.assert_close(got[0].ids, users.view(-1))
    torch.testing.assert_close(got[1].ids, items % 60)
    torch.testing.assert_close(got[2].ids, genres)


def test_ids_computed_with_a_parameter_get_no_program(single_process) -> None:
    assert _runner(ThreeTables(ids_from_inputs=False)).forward_pass.id_program is None


class RandomIds(nn.Module):
    """Sampling inside forward: running it ahead would draw different ids."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(30, 4)

    def forward(self, x: Tensor) -> Tensor:
        ids = torch.randint(30, (x.shape[0],))
        return self.embedding(ids).sum(dim=1) + x


def test_random_ids_in_forward_get_no_program(single_process) -> None:
    assert _runner(RandomIds()).forward_pass.id_program is None


def test_mixed_model_reads_both_tables_ahead(single_process) -> None:
    assert _runner(Mixed()).forward_pass.id_program is not None


def _all_to_alls_per_step(model: nn.Module, monkeypatch: pytest.MonkeyPatch) -> int:
    runner = parallax.get_runner(model, torch.optim.Adagrad(model.parameters(), lr=0.1),
                                 nn.functional.mse_loss,
                                 config=parallax.Config(sparsity_warmup_steps=100))
    calls = []
    # one rank: an exchange is a copy, not a collective; counted all the same, as the
    # all_to_alls that open a step's pull and the hops' sends (which a group of one copies
    # without an all_to_all)
    real, real_start = exchange.all_to_all, exchange.Hop._start

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(*args, **kwargs)

    def counted_start(self, payloads, send, receive, *, async_op):  # type: ignore[no-untyped-def]
        calls.append(1)
        with monkeypatch.context() as inside:  # a send is one exchange, however it is made
            inside.setattr(exchange, "all_to_all", real)
            return real_start(self, payloads, send, receive, async_op=async_op)

    for module in list(sys.modules.values()):  # every module that imported it by name
        if getattr(module, "all_to_all", None) is real:
            monkeypatch.setattr(module, "all_to_all", counted)
    monkeypatch.setattr(exchange.Hop, "_start", counted_start)
    runner.step(_batch(torch.Generator().manual_seed(1)))
    parallax.shutdown()
    return len(calls)


def test_look_ahead_pulls_and_pushes_all_tables_in_one_exchange(monkeypatch) -> None:
    torch.manual_seed(0)
    ahead = _all_to_alls_per_step(ThreeTables(), monkeypatch)
    torch.manual_seed(0)
    one_by_one = _all_to_alls_per_step(ThreeTables(ids_from_inputs=False), monkeypatch)
    # counts, ids, rows, gradients: once for all tables, or once per table
    assert (ahead, one_by_one) == (4, 12)


def test_look_ahead_trains_like_the_single_device_program(monkeypatch) -> None:
    torch.manual_seed(0)
    reference = ThreeTables()
    model = ThreeTables()
    model.load_state_dict(reference.state_dict())
    runner = parallax.get_runner(model, torch.optim.Adagrad(model.parameters(), lr=0.1),
                                 nn.functional.mse_loss)
    assert runner.forward_pass.id_program is not None
    optimizer = torch.optim.Adagrad(reference.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(2)
    for _ in range(4):
        inputs, targets = _batch(generator)
        runner.step((inputs, targets))
        optimizer.zero_grad()
        nn.functional.mse_loss(reference(*inputs), targets).backward()
        optimizer.step()
    trained = runner.state_dict()
    parallax.shutdown()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(trained[name], value, msg=name)


def test_the_look_ahead_finds_a_layer_as_get_submodule_does() -> None:
    """Its registry walk (`forward._submodule`) gives ``get_submodule``'s module for every
    path, the root for the empty one, and ``get_submodule``'s error for a bad one."""
    from parallax.step.forward import _submodule
    model = nn.Sequential(nn.ModuleList([nn.Linear(2, 2), nn.Sequential(nn.Embedding(3, 2))]))
    for path, _ in model.named_modules():
        assert _submodule(model, path) is model.get_submodule(path), path
    with pytest.raises(AttributeError, match="has no attribute `nope`"):
        _submodule(model, "0.nope")
