"""Cases of owner-side pooling (`Config.pooled_tables`, `Config.pooled_by_rows`,
`Config.pooled_by_columns`), shared by the
worker (tests/scripts/pooled_worker.py) and the single-device reference (tests/integration/
test_pooled.py): an EmbeddingBag over variable-length bags with every option the owner must
reproduce (mode, per-sample weights, padding_idx, include_last_offset, sparse gradients), one
over fixed-length 2-D bags, an nn.Embedding whose rows are averaged (or summed) over pairs of
ids beside them, an MLP on top."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import parallax

GLOBAL_BATCH = 8
HISTORY_ROWS, USER_ROWS, ITEM_ROWS, DIM = 300, 40, 60, 6
POOLED = ("history.weight", "user.weight")


@dataclass(frozen=True)
class Case:
    name: str
    mode: str = "sum"
    weights: bool = False
    padding_idx: int | None = None
    last_offset: bool = False
    sparse: bool = False
    optimizer: str = "sgd"
    clip: float | None = None
    pooled: tuple[str, ...] | None = POOLED  # None: the planner decides
    by_rows: tuple[str, ...] = ()  # Config.pooled_by_rows
    by_columns: tuple[str, ...] = ()  # Config.pooled_by_columns
    meta: bool = False  # the workers build it in parallax.meta_init (servers make their rows)
    free_bytes: int | None = None  # what the planner sees free on every process (None: real)
    item_reduce: str = "mean"  # how the items' nn.Embedding rows are reduced over each pair
    steps: int = 6


CASES = [
    Case("sum-weights-momentum-clip", weights=True, optimizer="momentum", clip=0.05),
    Case("mean-padding-adagrad", mode="mean", padding_idx=0, optimizer="adagrad"),
    Case("max-last-offset-adam", mode="max", last_offset=True, optimizer="adam"),
    Case("sparse-sum-adagrad", sparse=True, optimizer="adagrad", weights=True),
    Case("rows-pulled", mode="mean", padding_idx=0, optimizer="adagrad", pooled=()),
    # pooled by rows: each server its rows' share of every bag, added by the worker
    Case("by-rows-sum-weights-adagrad", weights=True, optimizer="adagrad",
         pooled=("user.weight",), by_rows=("history.weight", "item.weight")),
    Case("by-rows-mean-padding-last-offset-adam", mode="mean", padding_idx=0, last_offset=True,
         optimizer="adam", pooled=(), by_rows=POOLED),
    # pooled by columns: each server a column slice of every bag, put side by side
    Case("by-columns-sum-weights-momentum-clip", weights=True, optimizer="momentum", clip=0.05,
         pooled=("user.weight",), by_columns=("history.weight",)),
    Case("by-columns-max-padding-last-offset-adam", mode="max", padding_idx=0,
         last_offset=True, optimizer="adam", pooled=(), by_columns=POOLED),
    Case("by-columns-mean-sparse-adagrad-meta-init", mode="mean", sparse=True,
         optimizer="adagrad", pooled=("user.weight",),
         by_columns=("history.weight", "item.weight"), meta=True),
    # an nn.Embedding whose rows are only summed over each row of ids: its owner pools them
    Case("embedding-pooled-sum-adam", optimizer="adam", item_reduce="sum",
         pooled=(*POOLED, "item.weight")),
    # the planner pools what saves bytes (its threshold lowered to 0 bytes by the worker)
    Case("planner-decides", mode="mean", padding_idx=0, optimizer="adagrad", pooled=None),
    # the history (43,200 B with its gradient and Adagrad's sum) fits no server whole, and a
    # max is no sum of rows' shares: the planner cuts it into 2 column slices of 21,600 B
    Case("planner-cuts-columns", mode="max", optimizer="adagrad", pooled=None,
         free_bytes=30_000),
]
RESUMED = "mean-padding-adagrad"  # checkpointed halfway, resumed on another shape
RESUMED_BY_ROWS = "by-rows-mean-padding-last-offset-adam"  # the same, into ckpt-by-rows
RESUMED_BY_COLUMNS = "by-columns-max-padding-last-offset-adam"  # into ckpt-by-columns


class BagModel(nn.Module):
    def __init__(self, case: Case) -> None:
        super().__init__()
        self.history = nn.EmbeddingBag(HISTORY_ROWS, DIM, mode=case.mode,
                                       padding_idx=case.padding_idx,
                                       include_last_offset=case.last_offset, sparse=case.sparse)
        self.user = nn.EmbeddingBag(USER_ROWS, DIM, mode="mean", sparse=case.sparse)
        self.item = nn.Embedding(ITEM_ROWS, DIM, sparse=case.sparse)
        self.item_reduce = case.item_reduce
        self.hidden = nn.Linear(3 * DIM, 8)
        self.out = nn.Linear(8, 3)

    def forward(self, history: Tensor, offsets: Tensor, weights: Tensor | None,
                users: Tensor, items: Tensor) -> Tensor:
        rows = self.item(items)
        item = rows.mean(dim=1) if self.item_reduce == "mean" else torch.sum(rows, 1)
        pooled = torch.cat([self.history(history, offsets, per_sample_weights=weights),
                            self.user(users), item], dim=1)
        return self.out(torch.tanh(self.hidden(pooled)))


def build(case: Case, *, deferred: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The case's model and optimizer; ``deferred``: built in `parallax.meta_init`."""
    torch.manual_seed(0)
    with parallax.meta_init(threshold_bytes=0) if deferred else contextlib.nullcontext():
        model = BagModel(case).double()
    params = model.parameters()
    optimizer = {
        "sgd": lambda: torch.optim.SGD(params, lr=0.3),
        "momentum": lambda: torch.optim.SGD(params, lr=0.3, momentum=0.9),
        "adagrad": lambda: torch.optim.Adagrad(params, lr=0.3),
        "adam": lambda: torch.optim.Adam(params, lr=0.05),
    }[case.optimizer]()
    return model, optimizer


Sample = tuple[Tensor, Tensor]  # a bag's ids and weights
Batch = tuple[tuple[list[Sample], Tensor, Tensor], Tensor]


def batches(case: Case) -> list[Batch]:
    """``case.steps`` global batches: bags of 0 to 12 ids (the padding id among them), users
    as bags of 3, items as pairs, 3 classes."""
    generator = torch.Generator().manual_seed(7)
    out = []
    for _ in range(case.steps):
        bags = []
        for _ in range(GLOBAL_BATCH):
            length = int(torch.randint(0, 13, (1,), generator=generator))
            ids = torch.randint(0, HISTORY_ROWS, (length,), generator=generator)
            ids[::5] = 0  # the padding id, where there is one
            bags.append((ids, torch.rand(length, generator=generator, dtype=torch.float64)))
        users = torch.randint(0, USER_ROWS, (GLOBAL_BATCH, 3), generator=generator)
        items = torch.randint(0, ITEM_ROWS, (GLOBAL_BATCH, 2), generator=generator)
        targets = torch.randint(0, 3, (GLOBAL_BATCH,), generator=generator)
        out.append(((bags, users, items), targets))
    return out


def inputs(case: Case, bags: list[Sample], users: Tensor, items: Tensor) -> tuple:
    """The model's arguments for these samples: flat ids with offsets (one more at the end
    under include_last_offset), weights or None."""
    lengths = torch.tensor([ids.numel() for ids, _ in bags])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    if not case.last_offset:
        offsets = offsets[:-1]
    flat = torch.cat([ids for ids, _ in bags])
    weights = torch.cat([w for _, w in bags]) if case.weights else None
    return flat, offsets, weights, users, items


def worker_slice(case: Case, batch: Batch, rank: int, world: int) -> tuple[tuple, Tensor]:
    """Worker ``rank``'s consecutive share of the global batch, as the model's arguments."""
    (bags, users, items), targets = batch
    per = GLOBAL_BATCH // world
    part = slice(rank * per, (rank + 1) * per)
    return inputs(case, bags[part], users[part], items[part]), targets[part]


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    # as a GPU program moves its targets (an own loop's output is on the worker's device)
    return F.cross_entropy(output, target.to(output.device))


def single_device(case: Case) -> dict[str, Tensor]:
    """The plain program's parameters after training ``case`` on the global batches."""
    model, optimizer = build(case)
    for (bags, users, items), targets in batches(case):
        optimizer.zero_grad()
        loss = loss_fn(model(*inputs(case, bags, users, items)), targets)
        loss.backward()
        if case.clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip)
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
