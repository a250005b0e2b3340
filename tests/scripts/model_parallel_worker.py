"""Worker of the model/2-D parallelism tests (`Config.parallelism`).

Trains an MLP whose widths no group size divides (a column/row pair and a gathered layer)
under every grid of this world with SGD, momentum and Adam; a model with an embedding bag on
the sparse servers under the 2-D grid; clipping; a checkpoint saved on one grid and resumed on
another; and a `parallax.shard` loader's batches. Saves on rank 0: each run's exported state,
every rank's bytes per communicator and the splits, and the single-device references.

Usage: parallax run --nproc-per-machine W model_parallel_worker.py OUT.pt CKPT_DIR"""

import sys

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.utils.data import DataLoader, TensorDataset

import parallax
import parallax.checkpoint
from parallax.launch.fast_exit import exit_now

GLOBAL, STEPS, ROWS = 8, 4, 300
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
}


def net() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 9), nn.Tanh(), nn.Linear(9, 6))


class Mixed(nn.Module):
    """An embedding bag (sparse: on the servers) under a split dense body."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.EmbeddingBag(ROWS, 6, mode="mean")
        self.body = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))

    def forward(self, tokens: Tensor) -> Tensor:
        return self.body(self.embedding(tokens))


class Routed(nn.Module):
    """A linear layer outside any Sequential that only rows with ``x[:, 0] > 3`` reach: a
    step's data replica without such rows gives it no gradient (find_unused_parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = net()
        self.aux = nn.Linear(5, 6)

    def forward(self, x: Tensor) -> Tensor:
        out = self.body(x)
        rare = x[:, 0] > 3
        if bool(rare.any()):
            out = out + self.aux(x) * rare.unsqueeze(1)
        return out


def routed_batch(step: int) -> tuple[Tensor, Tensor]:
    """Rare rows in replica 0 only (step 0), replica 1 only (1), none (2), both (3)."""
    x, y = net_batch(step)
    x = x.clone()
    x[:, 0] = x[:, 0].clamp(-2, 2)
    for row in {0: [1], 1: [6], 2: [], 3: [0, 7]}[step % 4]:
        x[row, 0] = 5.0
    return x, y


def net_batch(step: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(GLOBAL, 5, generator=g, dtype=torch.float64)
    return x, torch.randn(GLOBAL, 6, generator=g, dtype=torch.float64)


def mixed_batch(step: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(900 + step)
    return (torch.randint(0, ROWS, (GLOBAL, 4), generator=g),
            torch.randint(0, 3, (GLOBAL,), generator=g))


def part(batch: tuple[Tensor, Tensor], replicas: int, index: int) -> tuple[Tensor, Tensor]:
    rows = GLOBAL // replicas
    return batch[0][index * rows:(index + 1) * rows], batch[1][index * rows:(index + 1) * rows]


def single_device(make, optimizer: str, batches, loss_fn, steps: int,
                  clip: float | None = None) -> dict[str, Tensor]:
    torch.manual_seed(0)
    model = make().double()
    opt = OPTIMIZERS[optimizer](model.parameters())
    for step in range(steps):
        opt.zero_grad()
        x, y = batches(step)
        loss_fn(model(x), y).backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(make, optimizer: str, batches, loss_fn, config: parallax.Config, steps: int,
          *, start: int = 0, checkpoint: str | None = None, resume: str | None = None,
          dcp: str | None = None):
    torch.manual_seed(0)
    model = make().double()
    runner = parallax.get_runner(model, OPTIMIZERS[optimizer](model.parameters()), loss_fn,
                                 config=config)
    grid = runner.parallelism.grid
    index = runner.worker.rank // grid.model
    if resume is not None:
        runner.load(resume)
    runner.reset_stats()
    for step in range(start, start + steps):
        runner.step(part(batches(step), grid.data, index))
    record = {"bytes": runner.parallelism.bytes_per_step(), "grid": (grid.data, grid.model),
              "splits": getattr(runner.parallelism, "splits", []),
              "last_grad_norm": runner.last_grad_norm}
    if checkpoint is not None:
        runner.save(checkpoint)
    record["state"] = runner.state_dict()
    if dcp is not None:  # DTensor shards through DCP: each rank writes its own
        parallax.checkpoint.save_dcp(runner, dcp)
        dist.barrier()
        record["dcp"] = parallax.checkpoint.load_dcp(dcp)
        record["dcp_chunks"] = {
            key: len(item.chunks) for key, item in
            FileSystemReader(dcp).read_metadata().state_dict_metadata.items()}
    everyone = [None] * runner.worker.world_size
    dist.all_gather_object(everyone, {"bytes": record["bytes"], "stats": runner.stats(),
                                      "memory": runner.predicted_memory()})
    record["ranks"] = everyone
    return record


def loader_batches(world: int) -> list:
    """The first batch of a shard-ed loader (2 samples per worker) on each rank, 2-D grid."""
    data = TensorDataset(torch.arange(40, dtype=torch.float64).view(20, 2),
                         torch.arange(20, dtype=torch.float64))
    loader = parallax.shard(DataLoader(data, batch_size=2))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 1)).double()
    runner = parallax.get_runner(
        model, torch.optim.SGD(model.parameters(), lr=0.01),
        lambda out, y: nn.functional.mse_loss(out.squeeze(1), y),
        config=parallax.Config(parallelism="2d", mesh=(2, world // 2), partition_cache=None))
    inputs, targets = next(iter(loader))
    runner.step((inputs, targets))
    everyone = [None] * world
    dist.all_gather_object(everyone, {"targets": targets.tolist(),
                                      "global_batch": loader.global_batch, "len": len(loader)})
    return everyone


def main() -> None:
    out, ckpt = sys.argv[1], sys.argv[2]
    world = dist.get_world_size() if dist.is_initialized() else int(
        __import__("os").environ["WORLD_SIZE"])
    grids = {"model": dict(parallelism="model")}
    if world == 4:
        grids["2d"] = dict(parallelism="2d", mesh=(2, 2))
    mse, ce = nn.functional.mse_loss, nn.functional.cross_entropy
    results: dict = {"world": world, "single": {}, "runs": {}}
    base = dict(partition_cache=None, sparsity_warmup_steps=2)
    for grid, options in grids.items():
        for optimizer in OPTIMIZERS:
            config = parallax.Config(**base, **options)
            results["runs"][(grid, optimizer)] = train(net, optimizer, net_batch, mse, config,
                                                      STEPS)
    clipped = parallax.Config(**base, **grids[list(grids)[-1]], clip_grad_norm=0.05)
    results["runs"]["clip"] = train(net, "momentum", net_batch, mse, clipped, STEPS)
    every = parallax.Config(**base, **grids[list(grids)[-1]], model_split="every-layer")
    results["runs"]["every-layer"] = train(net, "adam", net_batch, mse, every, STEPS)
    mixed = parallax.Config(**base, **grids[list(grids)[-1]])
    results["runs"]["mixed"] = train(Mixed, "adam", mixed_batch, ce, mixed, STEPS)
    if world == 4:  # a data group of 2 whose replicas use different parameters
        routed = parallax.Config(**base, **grids["2d"], find_unused_parameters=True)
        results["runs"]["routed"] = train(Routed, "momentum", routed_batch, mse, routed, STEPS)
    # a checkpoint of the last grid, resumed on the pure model grid (or 1x1 data: world 2)
    first = train(net, "adam", net_batch, mse, parallax.Config(**base, **grids[list(grids)[-1]]),
                  2, checkpoint=ckpt, dcp=ckpt + "-dcp")
    other = dict(parallelism="model") if world == 4 else dict(parallelism="data")
    resumed = train(net, "adam", net_batch, mse, parallax.Config(**base, **other), STEPS - 2,
                    start=2, resume=ckpt)
    results["runs"]["resumed"] = resumed
    results["first_half"] = first["state"]
    results["first_dcp"], results["first_dcp_chunks"] = first["dcp"], first["dcp_chunks"]
    results["first_splits"] = first["splits"]
    results["loader"] = loader_batches(world) if world == 4 else None
    # "auto": the global batch comes from a shard-ed loader (GLOBAL samples per step)
    data = TensorDataset(torch.zeros(64, 5, dtype=torch.float64))
    keep = parallax.shard(DataLoader(data, batch_size=GLOBAL // world))
    results["runs"]["auto"] = train(net, "adam", net_batch, mse,
                                    parallax.Config(**base, parallelism="auto"), STEPS)
    del keep
    if dist.get_rank() == 0:
        for optimizer in OPTIMIZERS:
            results["single"][optimizer] = single_device(net, optimizer, net_batch, mse, STEPS)
        results["single"]["clip"] = single_device(net, "momentum", net_batch, mse, STEPS,
                                                  clip=0.05)
        results["single"]["mixed"] = single_device(Mixed, "adam", mixed_batch, ce, STEPS)
        results["single"]["routed"] = single_device(Routed, "momentum", routed_batch, mse,
                                                    STEPS)
        torch.save(results, out)
    parallax.shutdown()


if __name__ == "__main__":
    main()
    exit_now()
