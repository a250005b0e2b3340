"""Worker of the checkpoint tests: the equivalence suite's mixed model (embedding, bag, MLP;
Adam everywhere, clipping, float64) trained on a parallax.shard-ed loader with global batch
12, checkpointing every 2 steps into DIR and resuming from the newest checkpoint at start.

Usage: parallax run ... checkpoint_worker.py DIR STOP OUT [PARTITIONS] [--kill-at N]
[--architecture A]
trains until global step STOP (or the data ends), then rank 0 writes the exported state_dict
to OUT ("-": nowhere). --kill-at N: in the job's first attempt, rank 1 SIGKILLs itself in
step N (a crashed machine). --architecture A: Config.architecture (default hybrid).
--trained-before: the process first trains two other programs to their end and keeps them
alive (a get_runner run under allreduce, then an own loop under distribute, each on its own
parallax.shard loader), as a sweep or a notebook does, before this one."""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from equivalence_cases import Mixed, loss_fn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import parallax  # noqa: E402
from parallax.cluster import current_worker  # noqa: E402
from parallax.launch.fast_exit import exit_now  # noqa: E402

GLOBAL_BATCH, STEPS, VOCAB = 12, 10, 40


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(5)
    u = torch.rand(GLOBAL_BATCH * STEPS, 5, generator=generator, dtype=torch.float64)
    ids = (VOCAB ** u - 1).long().clamp(0, VOCAB - 1)
    return TensorDataset(ids, torch.randint(0, 4, (GLOBAL_BATCH * STEPS,), generator=generator))


def build(optimizer: str = "adam") -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model and its optimizer: Adam, or ("momentum") SGD with nesterov momentum and
    weight decay, whose servers defer the steps of untouched rows."""
    torch.manual_seed(0)
    model = Mixed().double()
    if optimizer == "momentum":
        return model, torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9, nesterov=True,
                                      weight_decay=0.01)
    return model, torch.optim.Adam(model.parameters(), lr=0.05)


def train_other_programs() -> list[object]:
    """Two earlier programs of this process, trained to their end (8 and 3 steps) and kept
    alive: what they hold must not reach the program after them."""
    held: list[object] = []
    worker = current_worker()
    model, optimizer = build("momentum")
    runner = parallax.get_runner(model, optimizer, loss_fn, config=parallax.Config(
        architecture="allreduce", collective_timeout_s=30))
    loader = parallax.shard(DataLoader(dataset(), batch_size=8 // worker.world_size,
                                       shuffle=True))
    for step, batch in enumerate(loader):
        if step == 8:
            break
        runner.step(batch)
    held += [runner, loader]
    model, optimizer = build()
    model, optimizer = parallax.distribute(model, optimizer, config=parallax.Config(
        collective_timeout_s=30))
    loader = parallax.shard(DataLoader(dataset(), batch_size=4 // worker.world_size))
    for step, (ids, targets) in enumerate(loader):
        if step == 3:
            break
        optimizer.zero_grad()
        loss_fn(model(ids), targets).backward()
        optimizer.step()
    return [*held, model, optimizer, loader]


def main() -> None:
    args = sys.argv[1:]
    earlier = train_other_programs() if "--trained-before" in args else []
    args = [arg for arg in args if arg != "--trained-before"]
    kill_at = None
    architecture = "hybrid"
    if "--architecture" in args:
        at = args.index("--architecture")
        architecture = args[at + 1]
        del args[at:at + 2]
    if "--kill-at" in args:
        at = args.index("--kill-at")
        kill_at = int(args[at + 1])
        del args[at:at + 2]
    directory, stop, out = args[0], int(args[1]), args[2]
    partitions = int(args[3]) if len(args) > 3 else None
    worker = current_worker()
    Path(directory).mkdir(parents=True, exist_ok=True)
    (Path(directory) / f"pid-{worker.rank}").write_text(str(os.getpid()))
    model, optimizer = build()
    config = parallax.Config(clip_grad_norm=0.05, num_partitions=partitions,
                             architecture=architecture,
                             checkpoint_dir=directory, checkpoint_every_steps=2,
                             collective_timeout_s=30)
    runner = parallax.get_runner(model, optimizer, loss_fn, config=config)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    # the README's port: the loader made inline after get_runner, which resumed (its
    # position waits for it: parallax.loader.resume_later)
    for batch in parallax.shard(DataLoader(dataset(),
                                           batch_size=GLOBAL_BATCH // worker.world_size)):
        if runner.global_step >= stop:
            break
        if kill_at is not None and first_attempt and worker.rank == 1 \
                and runner.global_step + 1 == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        runner.step(batch)
    state = runner.state_dict()
    if worker.rank == 0 and out != "-":
        torch.save({k: v.detach().clone() for k, v in state.items()}, out)
    del earlier
    parallax.shutdown()


if __name__ == "__main__":
    main()
    exit_now()
