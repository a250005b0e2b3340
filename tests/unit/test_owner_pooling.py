"""Pooling on the owners (`parallax.engine.tables.pooled`), sender and owner sides in one
process: each worker's call split into its owners' shares (`Pooling.shares`), every worker's share
pooled by each owner in one ``embedding_bag`` (`_pool_at_owner`), the shares added at the
worker (`Pooling.added`) and the rows' gradient written out (`_Merged.rows_gradient`). Each
worker's pooled rows must be what its own call gives on the whole table, and the rows'
gradient the sum of the workers' own backwards, whatever the calls' shapes: a last offset
short of the ids' end (torch's CPU kernel ends the last bag at the ids' end; the owner
follows it), weights on some workers only, empty bags, padding; held whole by one owner
(`Config.pooled_tables`: bit for bit), by rows on three (`Config.pooled_by_rows`: up to the
order of the shares' sums) or as three column slices (`Config.pooled_by_columns`: bit for
bit)."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from parallax.engine.tables import pooled
from parallax.engine.tables.columns import slices_view
from parallax.engine.tables.partitioning import RowPartitioning
from parallax.engine.tables.sharding import POOLED, POOLED_BY_ROWS, PooledByColumns
from parallax.errors import UnsupportedProgramError

ROWS, DIM = 12, 3


@dataclass
class _Call:
    ids: Tensor
    offsets: Tensor
    weights: Tensor | None


class _Table:
    """What pooling reads of a table: its partitioning, and one owner's rows (`owner`); held
    as ``columns`` column slices, its rows are the slices' (one partition each)."""

    before_read = None

    def __init__(self, weight: Tensor, owners: int, *, by_rows: bool,
                 owner: int | None = None, columns: int = 1) -> None:
        self.weight = weight
        self.num_rows = ROWS * columns
        self.sharding = (PooledByColumns(columns) if columns > 1 else
                         POOLED_BY_ROWS if by_rows else POOLED)
        self.partitioning = RowPartitioning(self.num_rows, owners, tuple(range(owners)))
        self.owner = owner
        self.worker = SimpleNamespace(rank=owner)

    def at(self, owner: int) -> _Table:
        return _Table(self.weight, self.partitioning.num_partitions,
                      by_rows=self.sharding.by_rows, owner=owner, columns=self.sharding.slices)

    def own_ids(self) -> Tensor:
        assert self.owner is not None
        return self.partitioning.rows_of_server(self.owner)

    def server_shard(self) -> nn.Parameter:
        rows = slices_view(self.weight, self.sharding.slices)
        return nn.Parameter(rows[self.own_ids()].clone())


@st.composite
def _calls(draw: st.DrawFn, modes: list[str]) -> tuple[list[_Call], str, bool, int | None]:
    mode = draw(st.sampled_from(modes))
    last = draw(st.booleans())
    padding = draw(st.sampled_from([None, 0, -1]))
    weighted = mode == "sum" and draw(st.booleans())
    calls = []
    for _ in range(draw(st.integers(1, 4))):
        ids = torch.tensor(draw(st.lists(st.integers(0, ROWS - 1), max_size=10)),
                           dtype=torch.long)
        cuts = sorted(draw(st.lists(st.integers(0, ids.numel()), max_size=4)))
        if last:  # a last offset short of the ids' end, too
            cuts = [0, *cuts] if cuts else [0, 0]
        elif cuts:
            cuts[0] = 0
        elif ids.numel():  # ids without bags: refused (`_refusal`), torch crashes on them
            cuts = [0]
        has = weighted and draw(st.booleans())
        weights = torch.rand(ids.numel(), dtype=torch.float64) if has else None
        calls.append(_Call(ids, torch.tensor(cuts, dtype=torch.long), weights))
    return calls, mode, last, padding


def _pool(table: _Table, calls: list[_Call], mode: str, last: bool,
          padding: int | None) -> tuple[list[Tensor], Tensor]:
    """Every worker's pooled rows through its owners, and the rows' gradient (whole table)
    for a random gradient of each (also returned by `_alone` for the same seed)."""
    owners = pooled.owners_of(table)  # type: ignore[arg-type]
    bag_calls = [pooled.BagCall(table, c.ids, c.offsets, c.weights, mode, padding,  # type: ignore[arg-type]
                                last) for c in calls]
    shares = [table.sharding.shares(call, owners, pooled._refusal(call) is not None)
              for call in bag_calls]
    owned = {}
    for owner in owners:
        header = torch.zeros(len(calls), pooled._FIELDS, dtype=torch.long)
        for w, (call, mine) in enumerate(zip(bag_calls, shares, strict=True)):
            header[w, pooled._IDS] = mine[owner].ids.numel()
            header[w, pooled._OFFSETS] = mine[owner].starts.numel()
            header[w, pooled._FLAGS] = pooled._HAS_WEIGHTS if call.weights is not None else 0
        received = torch.cat([torch.cat([m[owner].starts, m[owner].ids]) for m in shares])
        weights = [m[owner].weights for m in shares if m[owner].weights is not None]
        at_owner = pooled.BagCall(table.at(owner), bag_calls[0].ids, bag_calls[0].offsets,  # type: ignore[arg-type]
                                  None, mode, padding, last)
        owned[owner] = pooled._pool_at_owner(at_owner, header, received,
                                             torch.cat(weights) if weights else None, grad=True)
    outs, leaves = [], []
    for w, call in enumerate(bag_calls):
        parts = []
        for owner in owners:
            start = sum(owned[owner].bags[:w])
            parts.append(owned[owner].pooled[start:start + owned[owner].bags[w]].detach())
        leaf = torch.cat(parts).requires_grad_(True)
        leaves.append(leaf)
        outs.append(table.sharding.added(call, leaf, owners))
    grad = torch.zeros(ROWS, DIM, dtype=torch.float64)
    generator = torch.Generator().manual_seed(3)
    grads = [torch.randn(out.shape, generator=generator, dtype=torch.float64) for out in outs]
    for out, g in zip(outs, grads, strict=True):
        if out.numel():
            out.backward(g)
    for o, owner in enumerate(owners):
        width = DIM // table.sharding.slices
        pushed = torch.cat([leaf.grad.view(len(owners), -1, width)[o] if leaf.grad is not None
                            else torch.zeros(owned[owner].bags[w], width, dtype=torch.float64)
                            for w, leaf in enumerate(leaves)])
        rows_grad = owned[owner].backward(pushed) if pushed.numel() else None
        if rows_grad is not None:
            ids = table.at(owner).own_ids()[owned[owner].local_rows]
            slices_view(grad, table.sharding.slices).index_add_(0, ids, rows_grad)
    return [out.detach() for out in outs], grad


def _alone(weight: Tensor, calls: list[_Call], mode: str, last: bool,
           padding: int | None) -> tuple[list[Tensor], Tensor]:
    """The same calls, each worker's own on one device."""
    alone = nn.Parameter(weight.clone())
    outs = [F.embedding_bag(c.ids, alone, c.offsets, mode=mode, per_sample_weights=c.weights,
                            include_last_offset=last, padding_idx=padding) for c in calls]
    generator = torch.Generator().manual_seed(3)
    for out in outs:
        g = torch.randn(out.shape, generator=generator, dtype=torch.float64)
        if out.numel():
            out.backward(g)
    grad = alone.grad if alone.grad is not None else torch.zeros_like(weight)
    return [out.detach() for out in outs], grad


@settings(max_examples=60, deadline=None)
@given(_calls(["sum", "mean", "max"]))
def test_one_owner_pools_every_workers_call_as_each_alone_bit_for_bit(case) -> None:
    weight = torch.randn(ROWS, DIM, dtype=torch.float64)
    got, got_grad = _pool(_Table(weight, 1, by_rows=False), *case)
    want, want_grad = _alone(weight, *case)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert torch.allclose(got_grad, want_grad, rtol=0, atol=1e-12)


@settings(max_examples=60, deadline=None)
@given(_calls(["sum", "mean"]))
def test_three_owners_pool_their_rows_shares_and_the_worker_adds_them(case) -> None:
    weight = torch.randn(ROWS, DIM, dtype=torch.float64)
    got, got_grad = _pool(_Table(weight, 3, by_rows=True), *case)
    want, want_grad = _alone(weight, *case)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and torch.allclose(g, w, rtol=0, atol=1e-12)
    assert torch.allclose(got_grad, want_grad, rtol=0, atol=1e-12)


@settings(max_examples=60, deadline=None)
@given(_calls(["sum", "mean", "max"]))
def test_three_column_slices_pool_every_bag_and_the_worker_puts_them_side_by_side(
        case) -> None:
    weight = torch.randn(ROWS, DIM, dtype=torch.float64)
    got, got_grad = _pool(_Table(weight, 3, by_rows=False, columns=3), *case)
    want, want_grad = _alone(weight, *case)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert torch.allclose(got_grad, want_grad, rtol=0, atol=1e-12)


def test_max_pooled_by_rows_is_refused_naming_the_table_and_rank() -> None:
    table = _Table(torch.zeros(ROWS, DIM), 2, by_rows=True)
    table.name = "bag.weight"  # type: ignore[attr-defined]
    table.worker = type("W", (), {"rank": 3})()  # type: ignore[attr-defined]
    with pytest.raises(UnsupportedProgramError, match=r"^rank 3: parameter 'bag.weight' is "
                                                      r"pooled by rows .* mode='max'"):
        pooled.bag_call(table, torch.tensor([1]), torch.tensor([0]), None,  # type: ignore[arg-type]
                        mode="max", padding_idx=None, include_last_offset=False)


def test_ids_without_bags_are_refused_before_torch_crashes_on_them() -> None:
    """Torch's embedding_bag segfaults on ids with no bags; the owner must never run it."""
    table = _Table(torch.zeros(ROWS, DIM), 1, by_rows=False)
    for offsets, last in (([], False), ([0], True)):
        call = pooled.BagCall(table, torch.tensor([1, 2]),  # type: ignore[arg-type]
                              torch.tensor(offsets, dtype=torch.long), None, "sum", None, last)
        message = pooled._refusal(call)
        assert message is not None and "2 ids but no bags" in message
    empty = pooled.BagCall(table, torch.tensor([], dtype=torch.long),  # type: ignore[arg-type]
                           torch.tensor([], dtype=torch.long), None, "sum", None, False)
    assert pooled._refusal(empty) is None
