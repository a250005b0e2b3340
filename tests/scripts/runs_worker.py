"""Worker of tests/integration/test_runs.py: several programs trained one after another in
one process, as a sweep, a notebook or pretraining-then-fine-tuning does, each kept alive
after it ends (its model, optimizer, runner and parallax.shard loader).

Usage: parallax run ... runs_worker.py OUT_DIR. The programs, in order (rank 0 writes each
one's final state dict to OUT_DIR/NAME.pt):
  runner      get_runner (hybrid), the mixed model, Adam, Config clipping, 5 steps
  allreduce   the own loop under architecture="allreduce", SGD with nesterov momentum, 4 steps
  save        the own loop (hybrid), Adam, a checkpoint every 3 steps into OUT_DIR/ckpt, 3 steps
  resume      the same program again: it resumes from step 3 and trains to step 6
  model       get_runner under parallelism="model": an MLP split over the workers, 4 steps
  async       get_runner under sync="async-sparse", max_staleness=0 (equal to one device), 4 steps
  runner-again  `runner` once more (a notebook cell run again)
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from checkpoint_worker import GLOBAL_BATCH, build, dataset  # noqa: E402
from equivalence_cases import loss_fn  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import parallax  # noqa: E402
from parallax.cluster import current_worker  # noqa: E402
from parallax.launch.fast_exit import exit_now  # noqa: E402

TIMEOUT = 60


def mlp() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 6)).double()


def mlp_data() -> TensorDataset:
    generator = torch.Generator().manual_seed(4)
    return TensorDataset(torch.rand(GLOBAL_BATCH * 4, 5, generator=generator,
                                    dtype=torch.float64),
                         torch.rand(GLOBAL_BATCH * 4, 6, generator=generator,
                                    dtype=torch.float64))


def loader(data: TensorDataset) -> DataLoader:
    return parallax.shard(DataLoader(data, batch_size=GLOBAL_BATCH // current_worker().world_size))


def runner_program(steps: int = 5, **config: object) -> list[object]:
    model, optimizer = build()
    runner = parallax.get_runner(model, optimizer, loss_fn, config=parallax.Config(
        collective_timeout_s=TIMEOUT, **({"clip_grad_norm": 0.05} | config)))
    batches = loader(dataset())
    for step, batch in enumerate(batches):
        if step == steps:
            break
        runner.step(batch)
    return [runner.state_dict(), runner, batches]


def own_loop(model, optimizer, config: parallax.Config, steps: int) -> list[object]:
    batches = loader(dataset())  # made before distribute, as the README's port does
    model, optimizer = parallax.distribute(model, optimizer, config=config)
    for ids, targets in batches:
        if optimizer.parallax_runner.global_step >= steps:  # a resume starts further on
            break
        optimizer.zero_grad()
        loss_fn(model(ids), targets).backward()
        optimizer.step()
    return [model.state_dict(), model, optimizer, batches]


def model_program() -> list[object]:
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    runner = parallax.get_runner(model, optimizer, nn.functional.mse_loss,
                                 config=parallax.Config(parallelism="model",
                                                        collective_timeout_s=TIMEOUT))
    batches = loader(mlp_data())
    for batch in batches:
        runner.step(batch)
    return [runner.state_dict(), runner, batches]


def main() -> None:
    out = Path(sys.argv[1])
    rank = current_worker().rank
    checkpoints = out / "ckpt"
    kept: list[object] = []

    def save(name: str, trained: list[object]) -> None:
        state, *alive = trained
        if rank == 0:
            torch.save({k: v.detach().clone() for k, v in state.items()}, out / f"{name}.pt")
        kept.extend(alive)

    save("runner", runner_program())
    save("allreduce", own_loop(*build("momentum"), parallax.Config(
        architecture="allreduce", collective_timeout_s=TIMEOUT), steps=4))
    checkpointing = parallax.Config(checkpoint_dir=str(checkpoints), checkpoint_every_steps=3,
                                    collective_timeout_s=TIMEOUT)
    save("save", own_loop(*build(), checkpointing, steps=3))
    save("resume", own_loop(*build(), checkpointing, steps=6))
    save("model", model_program())
    save("async", runner_program(4, sync="async-sparse", max_staleness=0,
                                 clip_grad_norm=None))
    save("runner-again", runner_program())
    kept.clear()
    parallax.shutdown()


if __name__ == "__main__":
    main()
    exit_now()
