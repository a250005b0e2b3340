"""Worker of the dense-sync tests (`Config.dense_sync` "qsgd", "plump", "slim").

Trains, on every rank, (1) a model with an embedding on the sparse servers and a dense body under
each dense sync, and (2) a dense MLP under Slim-DP with local steps, keeping each round's state
for the test's own simulation of the algorithm. Saves on rank 0: the exported parameters, the
counted traffic, every rank's local values and the servers' values, the initial values and the
single-device program's parameters for the global batch.

Usage: parallax run --machines 2 --nproc-per-machine 2 dense_sync_worker.py OUT.pt"""

import sys

import torch
import torch.distributed as dist
from torch import Tensor, nn

import parallax
from parallax.launch.fast_exit import exit_now

ROWS, DIM, WIDTH, BATCH, TOKENS, STEPS = 400, 8, 24, 6, 5, 6
MLP_IN, MLP_WIDTH, MLP_STEPS = 6, 10, 8
SLIM = parallax.SlimDP(alpha=0.3, beta=0.1, reselect_every=3, sync_every=2, significance=0.5)
SLIM_NO_CORE = parallax.SlimDP(alpha=0.3, beta=0, reselect_every=3, sync_every=2)
RUNS = {
    "hierarchical": dict(dense_sync="hierarchical"),
    "plump": dict(dense_sync="plump"),
    "slim-all": dict(dense_sync="slim", slim=parallax.SlimDP(alpha=1, beta=1, reselect_every=4)),
    "slim-q1": dict(dense_sync="slim", slim=parallax.SlimDP(alpha=0.2, beta=0.1,
                                                            reselect_every=1)),
    "qsgd": dict(dense_sync="qsgd", qsgd=parallax.QSGD(bits=8, bucket_size=64)),
    "plump-qsgd": dict(dense_sync="plump", qsgd=parallax.QSGD(bits=4, bucket_size=32)),
}


class Mixed(nn.Module):
    """An embedding bag (sparse: on the servers) under a dense body (under the dense sync)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.EmbeddingBag(ROWS, DIM, mode="mean")
        self.body = nn.Sequential(nn.Linear(DIM, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 3))

    def forward(self, tokens: Tensor) -> Tensor:
        return self.body(self.embedding(tokens))


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(MLP_IN, MLP_WIDTH), nn.Tanh(), nn.Linear(MLP_WIDTH, 1))


def mixed_batch(step: int, rank: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return (torch.randint(0, ROWS, (BATCH, TOKENS), generator=g),
            torch.randint(0, 3, (BATCH,), generator=g))


def mlp_batch(step: int, rank: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(7000 + 1000 * step + rank)
    x = torch.randn(BATCH, MLP_IN, generator=g, dtype=torch.float64)
    return x, x.sum(dim=1, keepdim=True).sin()


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.2, momentum=0.9, weight_decay=1e-3)


def single_device(world: int) -> dict[str, Tensor]:
    """The mixed model on one device, each step on the global batch (the mean of the workers'
    mean losses: equal batch sizes)."""
    torch.manual_seed(0)
    model = Mixed().double()
    optimizer = sgd(model.parameters())
    for step in range(STEPS):
        optimizer.zero_grad()
        losses = [nn.functional.cross_entropy(model(mixed_batch(step, r)[0]),
                                              mixed_batch(step, r)[1]) for r in range(world)]
        torch.stack(losses).mean().backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def slim_mlp(slim: parallax.SlimDP) -> dict | None:
    """The MLP under ``slim``: on rank 0 every rank's copy, traffic and cores, the servers'
    values and the export; None elsewhere."""
    torch.manual_seed(0)
    model = mlp().double()
    initial = [p.detach().clone() for p in model.parameters()]
    config = parallax.Config(dense_sync="slim", slim=slim, partition_cache=None)
    runner = parallax.get_runner(model, sgd(model.parameters()), nn.functional.mse_loss,
                                 config=config)
    worker = runner.worker
    runner.reset_stats()
    sync = runner.dense.server
    traffic = []
    for step in range(MLP_STEPS):
        runner.step(mlp_batch(step, worker.rank))
        traffic.append({k: dict(v) for k, v in sync.traffic.bytes.items()})
    local = sync.local_values()
    everyone = [None] * worker.world_size
    dist.all_gather_object(everyone, {"local": local, "traffic": traffic,
                                      "core": [c.clone() for c in sync.core]})
    exported = runner.state_dict()
    servers = sync.global_values()  # collective
    if worker.rank != 0:
        return None
    return {"initial": initial, "ranks": everyone, "exported": exported, "global": servers,
            "ranges": sync.ranges, "servers": sync.servers, "n": sync.n, "rounds": sync.rounds}


def main() -> None:
    results = {}
    for run, options in RUNS.items():
        torch.manual_seed(0)
        model = Mixed().double()
        config = parallax.Config(sparsity_warmup_steps=2, partition_cache=None, **options)
        runner = parallax.get_runner(model, sgd(model.parameters()),
                                     nn.functional.cross_entropy, config=config)
        worker = runner.worker
        runner.reset_stats()
        for step in range(STEPS):
            runner.step(mixed_batch(step, worker.rank))
        state = runner.state_dict()
        mine = [p.detach().clone() for p in model.body.parameters()]
        everyone = [None] * worker.world_size
        dist.all_gather_object(everyone, mine)
        if worker.rank == 0:
            results[run] = {"state": state, "stats": runner.stats(), "copies": everyone}
    # Slim-DP with local steps on a dense MLP: every rank's copy after each round, with a
    # core and without one (the paper's beta = 0 ablation)
    for name, slim in (("mlp", SLIM), ("mlp-no-core", SLIM_NO_CORE)):
        record = slim_mlp(slim)
        if record is not None:
            results[name] = record
    if dist.get_rank() == 0:
        results["single"] = single_device(dist.get_world_size())
        torch.manual_seed(0)
        results["initial"] = Mixed().double().state_dict()
        torch.save(results, sys.argv[1])
    parallax.shutdown()


if __name__ == "__main__":
    main()
    exit_now()
