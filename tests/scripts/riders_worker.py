"""Worker of the riders tests (`parallax.engine.tables.riders`): the equivalence suite's Mixed
model (two tables, a small dense MLP whose gradients are summed by one all_to_all) trained for
the same steps through `Runner.step` (its dense sum and the step's verdict ride in the push)
and through the own-loop door (DDP's hook sums the dense part; the verdict rides). Rank 0 saves
both runs' parameters, how many steps' dense sums rode, how many full finiteness checks ran,
and the single-device program's parameters for the global batch.

Usage: parallax run --machines 1 --nproc-per-machine 2 riders_worker.py OUT.pt"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from equivalence_cases import Case, Mixed, global_batches, loss_fn, worker_slice  # noqa: E402

import parallax  # noqa: E402
from parallax.launch.fast_exit import exit_now  # noqa: E402
from parallax.step import gradients as step_gradients  # noqa: E402

CASE = Case("mixed", "adagrad")


def build() -> tuple[Mixed, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Mixed().double()
    return model, torch.optim.Adagrad(model.parameters(), lr=0.1)


def single_device() -> dict[str, torch.Tensor]:
    model, optimizer = build()
    for x, y in global_batches(CASE):
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def main() -> None:
    checks = []
    original = step_gradients.find_nonfinite
    step_gradients.find_nonfinite = lambda *a, **k: checks.append(1) or original(*a, **k)
    results: dict = {}
    config = parallax.Config(partition_cache=None)

    model, optimizer = build()
    runner = parallax.get_runner(model, optimizer, loss_fn, config=config)
    worker = runner.worker
    for batch in global_batches(CASE):
        runner.step(worker_slice(batch, worker.rank, worker.world_size))
    results["step"] = {"state": runner.state_dict(), "ridden": runner.dense.ridden,
                       "checks": len(checks)}

    checks.clear()
    model, optimizer = build()
    distributed, optimizer = parallax.distribute(model, optimizer, config=config)
    for batch in global_batches(CASE):
        x, y = worker_slice(batch, worker.rank, worker.world_size)
        optimizer.zero_grad()
        loss_fn(distributed(x), y).backward()
        optimizer.step()
    results["own loop"] = {"state": distributed.state_dict(),
                           "ridden": distributed.runner.dense.ridden, "checks": len(checks)}
    if worker.rank == 0:
        results["single"] = single_device()
        results["steps"] = len(global_batches(CASE))
        torch.save(results, sys.argv[1])
    parallax.shutdown()


if __name__ == "__main__":
    main()
    exit_now()
