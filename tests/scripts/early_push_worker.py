"""Worker of the early-push tests: a model whose two tables get their gradients at different
depths of the backward (the output table first, the input embedding after a dense body), as an
LM with a sampled softmax does. Trains each architecture with `Config.overlap_push` on and off
and saves, on rank 0, the exported parameters, the push schedule and how many exchanges left
before the backward ended; and the single-device program's parameters for the global batch.

Usage: parallax run --machines 2 --nproc-per-machine 2 early_push_worker.py OUT.pt"""

import sys

import torch
from torch import Tensor, nn

import parallax
from parallax.launch.fast_exit import exit_now

ROWS, DIM, WIDTH, BATCH, TOKENS, CANDIDATES, STEPS, WARMUP = 5000, 16, 384, 96, 6, 24, 6, 2
RUNS = {"hybrid-direct": dict(architecture="hybrid", local_aggregation=False),
        "hybrid": dict(architecture="hybrid"),
        "ps": dict(architecture="ps"),
        "optps": dict(architecture="optps")}


class TwoDepths(nn.Module):
    """embedding -> dense body -> logits against the rows of a second table."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(ROWS, DIM)
        self.body = nn.Sequential(nn.Linear(DIM, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH),
                                  nn.Tanh(), nn.Linear(WIDTH, DIM))
        self.softmax = nn.Embedding(ROWS, DIM)

    def forward(self, tokens: Tensor, candidates: Tensor) -> Tensor:
        hidden = self.body(self.embedding(tokens).mean(dim=1))
        return hidden @ self.softmax(candidates).t()


def global_batch(step: int, world: int) -> tuple[tuple[Tensor, Tensor], Tensor]:
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, ROWS, (world * BATCH, TOKENS), generator=g)
    candidates = torch.randint(0, ROWS, (world, CANDIDATES), generator=g)
    targets = torch.randint(0, CANDIDATES, (world * BATCH,), generator=g)
    return (tokens, candidates), targets


def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
    return nn.functional.cross_entropy(logits, targets)


def worker_batch(step: int, rank: int, world: int) -> tuple[tuple[Tensor, Tensor], Tensor]:
    (tokens, candidates), targets = global_batch(step, world)
    rows = slice(rank * BATCH, (rank + 1) * BATCH)
    return (tokens[rows], candidates[rank]), targets[rows]


def single_device(world: int) -> dict[str, Tensor]:
    """The same steps on one device: each worker's logits against its own candidates, the
    mean of the workers' losses (the global batch's mean: equal batch sizes)."""
    torch.manual_seed(0)
    model = TwoDepths().double()
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)
    for step in range(STEPS):
        optimizer.zero_grad()
        losses = []
        for rank in range(world):
            (tokens, candidates), targets = worker_batch(step, rank, world)
            losses.append(loss_fn(model(tokens, candidates), targets))
        torch.stack(losses).mean().backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def main() -> None:
    results = {}
    for run, options in RUNS.items():
        for overlap in (True, False):
            torch.manual_seed(0)
            model = TwoDepths().double()
            optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)
            # (pooled_tables=(): the embedding's rows are only averaged over each row of
            # tokens, bags the hybrid would pool on an owner; this is the rows' early push)
            config = parallax.Config(sparsity_warmup_steps=WARMUP, overlap_push=overlap,
                                     partition_cache=None, pooled_tables=(), **options)
            runner = parallax.get_runner(model, optimizer, loss_fn, config=config)
            worker = runner.worker
            for step in range(STEPS):
                runner.step(worker_batch(step, worker.rank, worker.world_size))
            state = runner.state_dict()
            early = runner.sync_mode.early
            if worker.rank == 0:
                results[f"{run}/{'on' if overlap else 'off'}"] = {
                    "state": {k: v.detach().clone() for k, v in state.items()},
                    "schedule": None if early is None else early.schedule,
                    "launched_early": None if early is None else early.launched_early,
                    "items": None if early is None else early.items_total,
                    "local_aggregation": runner.local_aggregation,
                    "sync": {p.name: p.sync for p in runner.plan.parameters}}
    if worker.rank == 0:
        results["single"] = single_device(worker.world_size)
        torch.save(results, sys.argv[1])
    parallax.shutdown()


if __name__ == "__main__":
    main()
    exit_now()
