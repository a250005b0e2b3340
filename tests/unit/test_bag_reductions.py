"""`parallax.model.bag_reductions`: an nn.Embedding's rows watched through the warm-up are
the same tensor (values and gradients), and only a sum or mean over each row of ids counts as
bags; any other use marks the rows as read otherwise."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from parallax.engine.tables.bag_use import BagUse
from parallax.model.bag_reductions import WatchedRows, watched

IDS = torch.tensor([[0, 2, 2], [1, 3, 0]])  # 2 bags of 3 ids


def _rows() -> tuple[Tensor, Tensor]:
    weight = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    return weight, F.embedding(IDS, weight)


POOLED: dict[str, Callable[[Tensor], Tensor]] = {
    "sum(1)": lambda r: r.sum(1), "mean(dim=1)": lambda r: r.mean(dim=1),
    "torch.sum(-2)": lambda r: torch.sum(r, -2), "torch.mean(dim=(1,))": lambda r: torch.mean(
        r, dim=(1,)), "shape then sum": lambda r: r.sum(1) * (r.shape[1] / r.size(1))}
OTHERWISE: dict[str, Callable[[Tensor], Tensor]] = {
    "sum over the batch": lambda r: r.sum(0), "keepdim": lambda r: r.sum(1, keepdim=True),
    "sum of everything": lambda r: r.sum(), "slice": lambda r: r[:, 0],
    "elementwise then sum": lambda r: (r * 2).sum(1), "max": lambda r: r.max(1).values,
    "another dtype": lambda r: r.sum(1, dtype=torch.float32).double(),
    "an lstm's input": lambda r: r.transpose(0, 1).sum(0),
    "in a list": lambda r: torch.cat([r, r], dim=2).sum(1),
    "as a keyword": lambda r: torch.add(torch.zeros(2, 3, 5, dtype=r.dtype), other=r).sum(1)}


@pytest.mark.parametrize("use", POOLED, ids=str)
def test_a_sum_or_mean_over_bags_counts_the_bags_and_changes_nothing(use: str) -> None:
    weight, rows = _rows()
    bag_use = BagUse()
    plain = POOLED[use](rows)
    plain.sum().backward()
    want = weight.grad.clone()
    weight.grad = None
    out = POOLED[use](watched(F.embedding(IDS, weight), IDS, bag_use))
    assert type(out) is Tensor and torch.equal(out, plain)  # (plain: only the rows watched)
    out.sum().backward()
    assert torch.equal(weight.grad, want)
    assert (bag_use.ids, bag_use.bags, bag_use.rows_read_otherwise) == (6, 2, False)


@pytest.mark.parametrize("use", OTHERWISE, ids=str)
def test_any_other_use_marks_the_rows_read_otherwise(use: str) -> None:
    _, rows = _rows()
    bag_use = BagUse()
    out = OTHERWISE[use](watched(rows, IDS, bag_use))
    assert torch.equal(out, OTHERWISE[use](rows))
    assert bag_use.rows_read_otherwise, use


def test_the_rows_are_the_lookup_itself() -> None:
    _, rows = _rows()
    out = watched(rows, IDS, BagUse())
    assert isinstance(out, WatchedRows) and out.data_ptr() == rows.data_ptr()
    assert out.grad_fn is not None and out.shape == (2, 3, 5)


class _Averaged(torch.nn.Module):
    """Items averaged (or summed) over each row of ids, the rows of which pool on an owner."""

    def __init__(self, reduce: str, padding_idx: int | None = None) -> None:
        super().__init__()
        self.reduce = reduce
        self.items = torch.nn.Embedding(30, 4, padding_idx=padding_idx)
        self.out = torch.nn.Linear(4, 2)

    def forward(self, ids: Tensor) -> Tensor:
        rows = self.items(ids)
        if self.reduce == "slice":  # a row read alone: no bag an owner could pool
            return self.out(rows[:, 0])
        pooled = rows.mean(dim=1) if self.reduce == "mean" else torch.sum(rows, 1)
        return self.out(pooled * (rows.shape[1] / rows.size(1)))  # (metadata reads)


def _train(model: torch.nn.Module, runner: object | None, steps: int = 4) -> None:
    generator = torch.Generator().manual_seed(3)
    optimizer = None if runner is not None else torch.optim.Adagrad(model.parameters(), lr=0.5)
    for _ in range(steps):
        batch = (torch.randint(30, (6, 3), generator=generator),
                 torch.randint(2, (6,), generator=generator))
        if runner is not None:
            runner.step(batch)  # type: ignore[attr-defined]
            continue
        assert optimizer is not None
        optimizer.zero_grad()
        F.cross_entropy(model(batch[0]), batch[1]).backward()
        optimizer.step()


class _Gathered(torch.nn.Module):
    """The same bags read by hand-written gathers (fx finds them): ``w[ids]``, F.embedding."""

    def __init__(self, reduce: str) -> None:
        super().__init__()
        self.reduce = reduce
        self.items = torch.nn.Parameter(torch.randn(30, 4))
        self.out = torch.nn.Linear(4, 2)

    def forward(self, ids: Tensor) -> Tensor:
        if self.reduce == "mean":
            return self.out(F.embedding(ids, self.items).mean(dim=1))
        return self.out(self.items[ids].sum(1))


@pytest.mark.parametrize("model_class, reduce, name", [
    (_Averaged, "mean", "items.weight"), (_Averaged, "sum", "items.weight"),
    (_Gathered, "mean", "items"), (_Gathered, "sum", "items")])
@pytest.mark.parametrize("pinned_by", ["pooled_tables", "sharding"])
def test_a_table_pinned_to_pool_trains_as_one_device(single_process, monkeypatch,
                                                     model_class: type, reduce: str,
                                                     name: str, pinned_by: str) -> None:
    import parallax
    from parallax.engine.tables import pooled

    ahead = []
    pool_ahead = pooled.pool_ahead
    monkeypatch.setattr(pooled, "pool_ahead", lambda calls: ahead.append(len(calls)) or
                        pool_ahead(calls))
    torch.manual_seed(0)
    model, reference = model_class(reduce).double(), model_class(reduce).double()
    reference.load_state_dict(model.state_dict())
    runner = parallax.get_runner(model, torch.optim.Adagrad(model.parameters(), lr=0.5),
                                 F.cross_entropy, config=parallax.Config(
                                     partition_cache=None, **(
                                         {"pooled_tables": (name,)} if pinned_by ==
                                         "pooled_tables" else {"sharding": {name: "pooled"}})))
    _train(model, runner)
    _train(reference, None)
    assert runner.layout.sparse[name].sharding.pools
    recorded = {p.name: p.sharding for p in runner.plan.parameters}
    field = "pooled_tables" if pinned_by == "pooled_tables" else f"sharding[{name!r}]"
    assert recorded[name] == "pooled" and f"(Config.{field})" in next(
        p.reason for p in runner.plan.parameters if p.name == name)
    assert ahead == [1] * 4  # pooled before each forward, by the id look-ahead
    state = runner.state_dict()
    for name, value in reference.state_dict().items():
        assert float((state[name] - value).abs().max()) <= 1e-12, name
    parallax.shutdown()


class _Twice(torch.nn.Module):
    """One table looked up twice per forward; the second lookup's rows reduced first, the
    first's twice (a sum and a mean of the same rows)."""

    def __init__(self) -> None:
        super().__init__()
        self.items = torch.nn.Embedding(30, 4)
        self.out = torch.nn.Linear(4, 2)

    def forward(self, ids: Tensor, more: Tensor) -> Tensor:
        first, second = self.items(ids), self.items(more)
        return self.out(second.mean(1) + first.sum(1) - 0.5 * first.mean(1))


def test_pooled_lookups_are_pooled_ahead_in_one_exchange_a_step(single_process,
                                                                 monkeypatch) -> None:
    """The id look-ahead pools every lookup of a pooled Embedding before the forward, all in
    one exchange (as a bag layer's), whatever order and however often the program then
    reduces their rows: the same parameters as one device."""
    import parallax
    from parallax.engine.tables import pooled

    exchanges = []
    pool_many = pooled.pool_many
    monkeypatch.setattr(pooled, "pool_many",
                        lambda calls: exchanges.append(len(calls)) or pool_many(calls))
    torch.manual_seed(0)
    model, reference = _Twice().double(), _Twice().double()
    reference.load_state_dict(model.state_dict())
    runner = parallax.get_runner(model, torch.optim.Adagrad(model.parameters(), lr=0.5),
                                 F.cross_entropy, config=parallax.Config(
                                     pooled_tables=("items.weight",), partition_cache=None))
    optimizer = torch.optim.Adagrad(reference.parameters(), lr=0.5)
    generator = torch.Generator().manual_seed(3)
    for _ in range(4):
        inputs = (torch.randint(30, (6, 3), generator=generator),
                  torch.randint(30, (6, 5), generator=generator))
        targets = torch.randint(2, (6,), generator=generator)
        runner.step((inputs, targets))
        optimizer.zero_grad()
        F.cross_entropy(reference(*inputs), targets).backward()
        optimizer.step()
    assert exchanges == [2] * 4  # both lookups, one exchange a step (not one a reduction)
    state = runner.state_dict()
    for name, value in reference.state_dict().items():
        assert float((state[name] - value).abs().max()) <= 1e-12, name
    parallax.shutdown()


@pytest.mark.parametrize("padding_idx, reduce, match", [
    (None, "slice", r"the bags of 'items.weight' are pooled .* applies __getitem__ to them"),
    (0, "mean", r"'items.weight' .* padding_idx=0")])
def test_a_pooled_embedding_read_otherwise_is_refused(single_process, padding_idx: int | None,
                                                      reduce: str, match: str) -> None:
    import parallax
    from parallax.errors import UnsupportedProgramError

    model = _Averaged(reduce, padding_idx).double()
    runner = parallax.get_runner(model, torch.optim.SGD(model.parameters(), lr=0.5),
                                 F.cross_entropy, config=parallax.Config(
                                     pooled_tables=("items.weight",), partition_cache=None))
    with pytest.raises(UnsupportedProgramError, match=match):
        _train(model, runner, steps=1)
    parallax.shutdown()


@pytest.mark.parametrize("reduce", ["mean", "sum"])
def test_a_gathers_bags_are_counted_in_the_warmup(single_process, reduce: str) -> None:
    """(the fx-rewritten forward runs the gather's stand-in: its rows are watched alike)"""
    import parallax

    model = _Gathered(reduce).double()
    runner = parallax.get_runner(model, torch.optim.SGD(model.parameters(), lr=0.5),
                                 F.cross_entropy, config=parallax.Config(
                                     sparsity_warmup_steps=2, alpha_threshold=1.0,
                                     partition_cache=None))
    _train(model, runner, steps=2)
    use = runner.layout.sparse["items"].bag_use
    assert (use.bags, use.ids, use.rows_read_otherwise) == (12, 36, False)
    assert "pooled on an owner" in {p.name: p.reason for p in runner.plan.parameters}["items"]
    parallax.shutdown()
