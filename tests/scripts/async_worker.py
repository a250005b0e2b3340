"""Worker of the asynchronous-training tests (`Config.sync` "async" / "async-sparse").

Runs, in one launch, and saves on rank 0:
- ``k0/<mode>/<optimizer>``: max_staleness=0 trained parameters (exported), with the
  single-device program's for the global batch under ``single/<optimizer>``;
- ``lost/<mode>``: SGD (lr 1, sums) on integer-valued gradients with random delays, so pushes
  interleave: every worker's pushed rows summed (all-reduced), what the servers applied, and
  the initial and final parameters;
- ``straggler/<bound>``: "async" with every worker sleeping BASE s per step and the last rank
  3x as long: each rank's wall time, the staleness gate's lags and waits, and the steps the
  straggler had finished when the rank finished its last;
- ``snapshot``: a checkpoint saved mid-run under "async" with pushes in flight until the
  save, the state_dict at that point, and a new runner's state_dict after loading it;
- ``skip``: Config(nonfinite="skip") with rank 1's loss NaN at one step;
- ``own_loop``: the user's loop (parallax.distribute), "async-sparse", max_staleness=0.

Usage: parallax run --machines 2 --nproc-per-machine 2 async_worker.py OUT.pt [CKPT_DIR]"""

import random
import sys
import time

import torch
import torch.distributed as dist
from torch import Tensor, nn

import parallax
from parallax.launch.fast_exit import exit_now

ROWS, DIM, BATCH, TOKENS, STEPS = 40, 3, 4, 3, 5
STRAGGLER_STEPS, BASE = 16, 0.05
MODES = {"async-sparse": dict(sync="async-sparse", architecture="hybrid"),
         "async": dict(sync="async", architecture="ps")}
OPTIMIZERS = {"momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01),
              "adam": lambda p: torch.optim.Adam(p, lr=0.01)}


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(ROWS, DIM)
        self.out = nn.Linear(DIM, 2)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.out(self.embedding(tokens).mean(dim=1))


def loss_fn(out: Tensor, targets: Tensor) -> Tensor:
    return nn.functional.cross_entropy(out, targets)


def global_batch(step: int, world: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randint(0, ROWS, (world * BATCH, TOKENS), generator=g),
            torch.randint(0, 2, (world * BATCH,), generator=g))


def worker_batch(step: int, rank: int, world: int) -> tuple[Tensor, Tensor]:
    tokens, targets = global_batch(step, world)
    rows = slice(rank * BATCH, (rank + 1) * BATCH)
    return tokens[rows], targets[rows]


def single_device(world: int, make_optimizer) -> dict[str, Tensor]:
    torch.manual_seed(0)
    model = Model().double()
    optimizer = make_optimizer(model.parameters())
    for step in range(STEPS):
        optimizer.zero_grad()
        loss_fn(model(global_batch(step, world)[0]), global_batch(step, world)[1]).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def equivalence(results: dict) -> None:
    for mode, options in MODES.items():
        for name, make in OPTIMIZERS.items():
            torch.manual_seed(0)
            model = Model().double()
            config = parallax.Config(max_staleness=0, partition_cache=None, **options)
            runner = parallax.get_runner(model, make(model.parameters()), loss_fn, config=config)
            worker = runner.worker
            for step in range(STEPS):
                runner.step(worker_batch(step, worker.rank, worker.world_size))
            state = runner.state_dict()
            if worker.rank == 0:
                results[f"k0/{mode}/{name}"] = state
                results.setdefault(f"single/{name}", single_device(worker.world_size, make))


class Integer(nn.Module):
    """Gradients that are integers: the loss is a sum of looked-up rows times integer
    weights (and, for the dense parameter, times integer counts)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(ROWS, DIM)
        self.scale = nn.Parameter(torch.zeros(DIM))

    def forward(self, tokens: Tensor) -> Tensor:
        return self.embedding(tokens).sum(dim=1) + self.scale


def integer_loss(out: Tensor, weights: Tensor) -> Tensor:
    return (out * weights).sum()


def lost_updates(results: dict) -> None:
    for mode, options in MODES.items():
        torch.manual_seed(0)
        model = Integer().double()
        with torch.no_grad():
            model.embedding.weight.copy_(torch.randint(-50, 50, (ROWS, DIM)).double())
        initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
        config = parallax.Config(partition_cache=None, average_sparse=False, average_dense=False,
                                 **options)
        runner = parallax.get_runner(model, torch.optim.SGD(model.parameters(), lr=1.0),
                                     integer_loss, config=config)
        worker = runner.worker
        if runner.sync_mode.training.state is not None:  # servers keep the sum of applied rows
            runner.sync_mode.training.state.count_applied = True
        dist.barrier(group=runner.group)  # before any push
        rng = random.Random(worker.rank)
        gen = torch.Generator().manual_seed(7 + worker.rank)
        pushed = torch.zeros(ROWS, DIM, dtype=torch.float64)
        pushed_scale = torch.zeros(DIM, dtype=torch.float64)
        for _ in range(20):
            tokens = torch.randint(0, ROWS, (BATCH, TOKENS), generator=gen)
            weights = torch.randint(-3, 4, (BATCH, DIM), generator=gen).double()
            for b in range(BATCH):
                for t in range(TOKENS):
                    pushed[tokens[b, t]] += weights[b]
            pushed_scale += weights.sum(dim=0)
            time.sleep(rng.random() * 0.004)
            runner.step((tokens, weights))
        final = runner.state_dict()
        state = runner.sync_mode.training.state
        applied = torch.zeros(ROWS, DIM, dtype=torch.float64)
        if state is not None:
            applied += state.applied_rows.get("embedding.weight", torch.zeros(ROWS, DIM,
                                                                               dtype=torch.float64))
        group = runner.group
        for tensor in (pushed, pushed_scale, applied):
            dist.all_reduce(tensor, group=group)
        if worker.rank == 0:
            results[f"lost/{mode}"] = dict(initial=initial, final=final, pushed=pushed,
                                           pushed_scale=pushed_scale, applied=applied)


def straggler(results: dict, bound: int | None) -> None:
    torch.manual_seed(0)
    model = Model()
    config = parallax.Config(sync="async", architecture="ps", max_staleness=bound,
                             partition_cache=None)
    runner = parallax.get_runner(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn,
                                 config=config)
    worker = runner.worker
    slow = worker.rank == worker.world_size - 1
    dist.barrier(group=runner.group)
    began = time.perf_counter()
    for step in range(STRAGGLER_STEPS):
        time.sleep(BASE * (3 if slow else 1))  # the work of a step, 3x on the straggler
        runner.step(worker_batch(step, worker.rank, worker.world_size))
    elapsed = time.perf_counter() - began
    gate = runner.sync_mode.training.gate
    # how many steps the straggler had finished when this worker finished its last
    straggler_done = gate.clocks()[worker.world_size - 1]
    mine = torch.tensor([elapsed, max(gate.lags, default=0), gate.waited_s, straggler_done],
                        dtype=torch.float64)
    everyone = [torch.empty_like(mine) for _ in range(worker.world_size)]
    dist.all_gather(everyone, mine, group=runner.group)
    if worker.rank == 0:
        results[f"straggler/{bound}"] = torch.stack(everyone)


def snapshot(results: dict, directory: str) -> None:
    torch.manual_seed(0)
    model = Model().double()
    config = parallax.Config(sync="async", architecture="ps", partition_cache=None)
    runner = parallax.get_runner(model, torch.optim.Adagrad(model.parameters(), lr=0.1),
                                 loss_fn, config=config)
    worker = runner.worker
    rng = random.Random(worker.rank)
    for step in range(6):
        time.sleep(rng.random() * 0.01)  # the workers' pushes interleave up to the save
        runner.step(worker_batch(step, worker.rank, worker.world_size))
    runner.save(directory)
    at_save = runner.state_dict()
    for step in range(6, 9):
        runner.step(worker_batch(step, worker.rank, worker.world_size))
    torch.manual_seed(0)
    model = Model().double()
    again = parallax.get_runner(model, torch.optim.Adagrad(model.parameters(), lr=0.1),
                                loss_fn, config=config)
    again.load(directory)
    loaded = again.state_dict()
    if worker.rank == 0:
        results["snapshot"] = dict(at_save=at_save, loaded=loaded, step=again.global_step)


def own_loop(results: dict) -> None:
    """The user's own loop (parallax.distribute) under "async-sparse" with max_staleness=0."""
    torch.manual_seed(0)
    model = Model().double()
    optimizer = OPTIMIZERS["adam"](model.parameters())
    config = parallax.Config(sync="async-sparse", max_staleness=0, partition_cache=None)
    model, optimizer = parallax.distribute(model, optimizer, config=config)
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(STEPS):
        tokens, targets = worker_batch(step, rank, world)
        optimizer.zero_grad()
        loss_fn(model(tokens), targets).backward()
        optimizer.step()
    state = model.state_dict()
    if rank == 0:
        results["own_loop"] = state


def skip(results: dict) -> None:
    torch.manual_seed(0)
    model = Model().double()
    config = parallax.Config(sync="async", architecture="ps", nonfinite="skip",
                             max_staleness=0, partition_cache=None)
    runner = parallax.get_runner(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn,
                                 config=config)
    worker = runner.worker

    def maybe_nan(out: Tensor, targets: Tensor) -> Tensor:
        loss = loss_fn(out, targets)
        return loss * float("nan") if worker.rank == 1 and runner.global_step == 2 else loss

    runner.loss_fn = maybe_nan
    for step in range(4):
        runner.step(worker_batch(step, worker.rank, worker.world_size))
    state = runner.state_dict()
    skipped = torch.tensor([runner.skipped_steps], dtype=torch.float64)
    dist.all_reduce(skipped, group=runner.group)
    if worker.rank == 0:
        results["skip"] = dict(state=state, skipped=int(skipped))


def main() -> None:
    results: dict = {}
    equivalence(results)
    lost_updates(results)
    straggler(results, None)
    straggler(results, 2)
    if len(sys.argv) > 2:
        snapshot(results, sys.argv[2])
    skip(results)
    own_loop(results)
    if dist.get_rank() == 0:
        torch.save(results, sys.argv[1])
    parallax.shutdown()


if __name__ == "__main__":
    main()
    exit_now()
