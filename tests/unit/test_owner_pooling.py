"""The owner pools every worker's bags of a call in one ``embedding_bag``
(`parallax.engine.tables.pooled._pool_at_owner`): each worker's pooled rows must be what its
own call gives on the whole table, bit for bit, and the rows' gradient the sum of the
workers' own backwards, whatever the calls' shapes (ids past the last offset, a worker
with no bags, weights on some workers only, empty bags, padding). Torch's CPU kernel ends
the last bag under ``include_last_offset`` at the ids' end whatever the last offset says;
the owner follows it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from parallax.engine.tables import pooled
from parallax.engine.tables.partitioning import RowPartitioning

ROWS, DIM = 12, 3


@dataclass
class _Worker:
    ids: Tensor
    offsets: Tensor
    weights: Tensor | None


class _Owner:
    """What `_pool_at_owner` reads of a pooled table: its rows whole in one shard."""

    num_rows = ROWS
    before_read = None

    def __init__(self, weight: Tensor) -> None:
        self.partitioning = RowPartitioning(ROWS, 1, (0,))
        self.shard = nn.Parameter(weight.clone())

    def server_shard(self) -> nn.Parameter:
        return self.shard


@st.composite
def _workers(draw: st.DrawFn) -> tuple[list[_Worker], str, bool, int | None]:
    mode = draw(st.sampled_from(["sum", "mean", "max"]))
    last = draw(st.booleans())
    padding = draw(st.sampled_from([None, 0, -1]))
    weighted = mode == "sum" and draw(st.booleans())
    workers = []
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
        workers.append(_Worker(ids, torch.tensor(cuts, dtype=torch.long), weights))
    return workers, mode, last, padding


def _message(workers: list[_Worker]) -> tuple[Tensor, Tensor, Tensor | None]:
    """The owner's view of one call: ``[sender, field]`` header, offsets+ids, weights."""
    header = torch.zeros(len(workers), pooled._FIELDS, dtype=torch.long)
    for w, worker in enumerate(workers):
        header[w, pooled._IDS] = worker.ids.numel()
        header[w, pooled._OFFSETS] = worker.offsets.numel()
        header[w, pooled._FLAGS] = pooled._HAS_WEIGHTS if worker.weights is not None else 0
    received = torch.cat([torch.cat([w.offsets, w.ids]) for w in workers])
    weights = [w.weights for w in workers if w.weights is not None]
    return header, received, torch.cat(weights) if weights else None


@settings(max_examples=60, deadline=None)
@given(_workers())
def test_one_bag_call_for_all_workers_is_each_workers_own_call(case) -> None:
    workers, mode, last, padding = case
    weight = torch.randn(ROWS, DIM, dtype=torch.float64)
    owner = _Owner(weight)
    call = pooled.BagCall(owner, torch.empty(0, dtype=torch.long), torch.empty(0), None,  # type: ignore[arg-type]
                          mode, padding, last)
    header, received, weights = _message(workers)
    owned = pooled._pool_at_owner(call, header, received, weights, grad=True)

    alone = nn.Parameter(weight.clone())
    grads, outs = [], []
    for worker in workers:
        out = F.embedding_bag(worker.ids, alone, worker.offsets, mode=mode,
                              per_sample_weights=worker.weights, include_last_offset=last,
                              padding_idx=padding)
        outs.append(out)
        grads.append(torch.randn_like(out))
    assert owned.bags == [o.shape[0] for o in outs]
    assert torch.equal(owned.pooled.detach(), torch.cat(outs).detach())
    rows_grad = None
    if outs and torch.cat(outs).numel():
        torch.autograd.backward(outs, grads)
        rows_grad = owned.backward(torch.cat(grads))
    want = alone.grad if alone.grad is not None else torch.zeros_like(weight)
    got = torch.zeros_like(weight)
    if rows_grad is not None:
        got.index_add_(0, owned.local_rows, rows_grad)
    assert torch.allclose(got, want, rtol=0, atol=1e-12)


def test_ids_without_bags_are_refused_before_torch_crashes_on_them() -> None:
    """Torch's embedding_bag segfaults on ids with no bags; the owner must never run it."""
    owner = _Owner(torch.zeros(ROWS, DIM))
    for offsets, last in (([], False), ([0], True)):
        call = pooled.BagCall(owner, torch.tensor([1, 2]),  # type: ignore[arg-type]
                              torch.tensor(offsets, dtype=torch.long), None, "sum", None, last)
        message = pooled._refusal(call)
        assert message is not None and "2 ids but no bags" in message
    empty = pooled.BagCall(owner, torch.tensor([], dtype=torch.long),  # type: ignore[arg-type]
                           torch.tensor([], dtype=torch.long), None, "sum", None, False)
    assert pooled._refusal(empty) is None
