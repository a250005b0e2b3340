"""Worker of benchmarks/model_parallel.py: trains fully connected ReLU networks under every
grid of this world on one data set, and measures, per (width, grid):

* ``wall_s``: the mean training step (after warm-up steps), as it ran here;
* ``replay_comm_s``: the step's collectives alone (the list `scheme_collectives` gives and the
  tests prove equal to what training sends), replayed on the same communicators with no
  compute beside them: communication measured on the (emulated) network;
* ``final_mse``: the exported model's MSE on the first 20,000 rows (all of airfoil);
* ``compute_s``: one process's share of a step (forward, backward and SGD step of its local
  shapes) timed on rank 0 while every other rank waits: single-thread compute uncontended;
* the cost model's prediction at the α, β measured at start-up, and the grid ``"auto"`` would
  choose (`parallax.parallelism.cost.predict_grids`, as ``parallelism="auto"`` calls it).

Usage (by model_parallel.py): parallax run ... model_parallel_worker.py '<json options>'"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import parallax
from parallax.launch.fast_exit import exit_now
from parallax.parallelism.cost import (
    choose_grid,
    grids_of,
    local_shape,
    measure_link,
    predict_grids,
    scheme_collectives,
)
from parallax.parallelism.grid import Grid
from parallax.parallelism.splits import plan_splits


def network(inputs: int, width: int, outputs: int, hidden: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    size = inputs
    for _ in range(hidden):
        layers += [nn.Linear(size, width), nn.ReLU()]
        size = width
    return nn.Sequential(*layers, nn.Linear(size, outputs))


def dataset(options: dict) -> TensorDataset:
    if options["data"] == "airfoil":
        rows = [line.split("\t") for line in Path(options["airfoil"]).read_text().splitlines()[1:]]
        table = torch.tensor([[float(v) for v in row] for row in rows])
        table = (table - table.mean(0)) / table.std(0)  # standardised features and target
        return TensorDataset(table[:, :5].contiguous(), table[:, 5:].contiguous())
    g = torch.Generator().manual_seed(0)  # synthetic, of UCI Ethylene's shape
    x = torch.randn(options["rows"], 16, generator=g)
    w = torch.randn(16, 2, generator=g)
    y = torch.tanh(x @ w) + 0.1 * torch.randn(options["rows"], 2, generator=g)
    return TensorDataset(x, y)


def replay(grid: Grid, runner: parallax.Runner, splits, batch: int, repeats: int) -> float:
    """Seconds per step of the step's collectives alone, on the run's communicators."""
    if grid.size == 1:
        return 0.0
    rank = runner.worker.rank
    mesh = getattr(runner.parallelism, "mesh", None)
    collectives = scheme_collectives(splits, grid, batch=batch, itemsize=4,
                                     model_index=rank % grid.model)
    plan = []
    for c in collectives:
        group = (mesh.model_group if c.communicator == "model" else mesh.data_group) \
            if mesh is not None else runner.group
        n = c.group
        if c.kind == "all_reduce":
            elements = max(1, round(c.sent * n / (2 * (n - 1)) / 4))
            plan.append(("all_reduce", torch.zeros(elements), group))
        else:
            piece = max(1, round(c.sent / (n - 1) / 4))
            plan.append(("all_gather", (torch.zeros(piece), torch.zeros(piece * n)), group))
    times = []
    for _ in range(repeats + 2):
        dist.barrier(group=runner.group)
        began = time.perf_counter()
        for kind, tensors, group in plan:
            if kind == "all_reduce":
                dist.all_reduce(tensors, group=group)
            else:
                dist.all_gather_into_tensor(tensors[1], tensors[0], group=group)
        times.append(time.perf_counter() - began)
    return sorted(times[2:])[len(times[2:]) // 2]


def local_compute(splits, grid: Grid, inputs: int, outputs: int, batch: int,
                  steps: int) -> float:
    """One process's share of a training step, alone: its local shapes' forward, backward and
    SGD step (median of ``steps``). Each layer gets an input of its own local width (a
    gathered layer's output is whole again after its gather, a column split's stays split),
    with a gradient wanted for every input but the first, as the chained layers need."""
    rows = batch // grid.data
    layers = [nn.Linear(*local_shape(s, grid.model)) for s in splits]
    xs = [torch.randn(rows, layer.in_features, requires_grad=i > 0)
          for i, layer in enumerate(layers)]
    opt = torch.optim.SGD([p for layer in layers for p in layer.parameters()], lr=0.01)
    times = []
    for _ in range(steps + 3):
        began = time.perf_counter()
        opt.zero_grad()
        sum(torch.relu(layer(x)).square().mean() for layer, x in zip(layers, xs, strict=True)
            ).backward()
        opt.step()
        times.append(time.perf_counter() - began)
    return sorted(times[3:])[len(times[3:]) // 2]


def main() -> None:
    options = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    data = dataset(options)
    inputs, outputs = data.tensors[0].shape[1], data.tensors[1].shape[1]
    batch = options["batch"]
    split = options.get("model_split", "pairs")  # Config.model_split of the split grids
    pairs = split == "pairs"
    records = []
    link = None
    for width in options["widths"]:
        for grid_degrees in options.get("grids") or [None]:
            world = dist.get_world_size() if dist.is_initialized() else None
            torch.manual_seed(0)
            model = network(inputs, width, outputs, options["hidden"])
            loader = parallax.shard(DataLoader(data, batch_size=batch // options["world"],
                                               shuffle=True, drop_last=True))
            if grid_degrees is None or grid_degrees[1] == 1:
                config = parallax.Config(partition_cache=None)
            else:
                config = parallax.Config(partition_cache=None, parallelism="2d",
                                         mesh=tuple(grid_degrees), model_split=split)
            runner = parallax.get_runner(model, torch.optim.SGD(model.parameters(), lr=0.01),
                                         nn.functional.mse_loss, config=config)
            world = runner.worker.world_size
            grid = runner.parallelism.grid
            if link is None:
                link = measure_link(runner.group, world)
            times, losses, step = [], [], 0
            while step < options["steps"]:
                for batch_data in loader:
                    began = time.perf_counter()
                    loss = runner.step(batch_data)
                    times.append(time.perf_counter() - began)
                    losses.append(float(loss))
                    step += 1
                    if step == options["steps"]:
                        break
            warm = options["warmup"]
            splits = plan_splits(network(inputs, width, outputs, options["hidden"]),
                                 grid.model, pairs=pairs)
            comm = replay(grid, runner, splits, batch, options["replay"])
            bytes_sent = runner.parallelism.bytes_per_step()
            if grid.model == 1:  # data parallelism: DDP's gradients, counted by the runner
                bytes_sent = {"model": 0.0, "data": sum(
                    v.get("intra_sent", 0.0) + v.get("inter_sent", 0.0)
                    for v in runner.stats().values())}
            state = runner.state_dict()  # the trained model, whole (collective)
            final_mse = None
            if runner.worker.rank == 0:
                trained = network(inputs, width, outputs, options["hidden"])
                trained.load_state_dict(state)
                rows = options.get("eval_rows", 20_000)  # of the whole data set at most
                with torch.no_grad():
                    final_mse = float(nn.functional.mse_loss(trained(data.tensors[0][:rows]),
                                                             data.tensors[1][:rows]))
            compute = None
            dist.barrier(group=runner.group)
            if runner.worker.rank == 0:
                compute = local_compute(splits, grid, inputs, outputs, batch, 20)
            dist.barrier(group=runner.group)
            record = {"width": width, "grid": [grid.data, grid.model], "world": world,
                      "wall_s": sum(times[warm:]) / max(1, len(times[warm:])),
                      "replay_comm_s": comm, "compute_s": compute,
                      "loss_last": sum(losses[-10:]) / len(losses[-10:]),
                      "final_mse": final_mse,
                      "bytes": bytes_sent}
            if runner.worker.rank == 0:
                predictions = predict_grids(network(inputs, width, outputs, options["hidden"]),
                                            world, batch=batch, link=link, pairs=pairs)
                chosen = choose_grid(predictions)
                record["predicted"] = {f"{p.grid.data}x{p.grid.model}": {
                    "comm_s": p.communication_s, "compute_s": p.compute_s,
                    "model_bytes": p.model_bytes, "data_bytes": p.data_bytes}
                    for p in predictions}
                record["auto"] = f"{chosen.grid.data}x{chosen.grid.model}"
            records.append(record)
            del runner, loader
    if dist.get_rank() == 0:
        Path(options["out"]).write_text(json.dumps({
            "records": records, "link": {"alpha": link.alpha, "beta": link.beta},
            "grids": [f"{g.data}x{g.model}" for g in grids_of(world)]}, indent=1))
    parallax.shutdown()


if __name__ == "__main__":
    main()
    exit_now()  # parallax.launch.fast_exit: no second of teardown per worker
