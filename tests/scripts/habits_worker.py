"""The launched habits of tests/habits.py on one worker of a 2-worker run, for
tests/integration/test_habits.py.

Usage: habits_worker.py OUT_DIR. Rank 0 writes OUT_DIR/KEY.pt (the trained single-device state
dict) for every launched habit with a program, OUT_DIR/ddp.pt (and ddp-retired.txt, what the
retired DDP wrapper says) for the DDP program, OUT_DIR/sampler.pt for the DistributedSampler
program, and
every rank OUT_DIR/rng-RANK.pt (torch.rand(4) drawn right after distribute and after an
iteration of a shuffled shard).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from datetime import timedelta  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from habits import (  # noqa: E402
    BY_KEY,
    HABITS,
    Run,
    batches,
    build,
    dataset,
    distributed,
    mse,
)

import parallax  # noqa: E402
from parallax.cluster import current_worker  # noqa: E402
from parallax.launch.fast_exit import exit_now  # noqa: E402


def two_epochs(model, optimizer, sampler, loader) -> None:
    """A DDP program's training loop: set_epoch, then every batch."""
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for ids, y in loader:
            optimizer.zero_grad()
            mse(model(ids), y).backward()
            optimizer.step()


def ddp_program(out: Path, world: int, rank: int) -> None:
    """A DDP program ported with the wrap alone: it initialises the default group itself,
    wraps the model in DDP with an fp16 comm hook, reads through its own DistributedSampler
    (not parallax.shard). Rank 0 also writes what parallax said of the hook (ddp-log.txt) and
    what a hook registered on the distributed model gets (ddp-hook.txt)."""
    import logging.handlers

    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    said = logging.handlers.BufferingHandler(100) if rank == 0 else None
    if said is not None:
        logging.getLogger("parallax").addHandler(said)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    model, optimizer, _ = build(BY_KEY["canonical"])
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(None, fp16_compress_hook)
    data = dataset()
    sampler = torch.utils.data.DistributedSampler(data, shuffle=True, seed=3)
    loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler)
    model, optimizer = parallax.distribute(ddp, optimizer)  # the only change
    two_epochs(model, optimizer, sampler, loader)
    state = model.state_dict()
    try:
        ddp(dataset().tensors[0][:2])
    except parallax.UnsupportedProgramError as error:
        retired = str(error)
    try:
        model.register_comm_hook(None, fp16_compress_hook)
    except parallax.UnsupportedProgramError as error:
        hooked = str(error)
    if said is not None:
        logging.getLogger("parallax").removeHandler(said)
        torch.save(state, out / "ddp.pt")
        (out / "ddp-retired.txt").write_text(retired)
        (out / "ddp-log.txt").write_text("\n".join(r.getMessage() for r in said.buffer))
        (out / "ddp-hook.txt").write_text(hooked)


def load_differs_program(out: Path, world: int, rank: int) -> None:
    """Every rank loads a state dict, rank 1's different (a file read mid-write)."""
    model, optimizer, _ = build(BY_KEY["canonical"])
    model, optimizer = parallax.distribute(
        model, optimizer, config=parallax.Config(partition_cache=None, collective_timeout_s=60))
    state = model.state_dict()
    state["head.bias"] = state["head.bias"] + rank
    try:
        model.load_state_dict(state)
        said = "loaded"
    except parallax.UnsupportedProgramError as error:
        said = str(error)
    (out / f"load-{rank}.txt").write_text(said)


def sampler_program(out: Path, world: int, rank: int) -> None:
    """A DDP program's loader: DistributedSampler with shuffle and set_epoch, 2 epochs."""
    model, optimizer, _ = build(BY_KEY["canonical"])
    data = dataset()
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=world, rank=rank,
                                                  shuffle=True, seed=3)
    loader = parallax.shard(torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler))
    model, optimizer = parallax.distribute(
        model, optimizer, config=parallax.Config(partition_cache=None, collective_timeout_s=60))
    two_epochs(model, optimizer, sampler, loader)
    state = model.state_dict()
    if rank == 0:
        torch.save(state, out / "sampler.pt")


def sum_averaged_program(out: Path, world: int, rank: int) -> None:
    """A sum loss, plain SGD at lr 0.1, gradients averaged over the workers (the default)."""
    model, _, _ = build(BY_KEY["canonical"])
    model, optimizer = parallax.distribute(
        model, torch.optim.SGD(model.parameters(), lr=0.1),
        config=parallax.Config(partition_cache=None, collective_timeout_s=60))
    for ids, y in batches(world, rank):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(ids), y, reduction="sum").backward()
        optimizer.step()
    state = model.state_dict()
    if rank == 0:
        torch.save(state, out / "sum_averaged.pt")


def lr_per_rank_program(out: Path, world: int, rank: int) -> None:
    """A learning rate set from what one rank alone sees (here: the rank itself, as a
    ReduceLROnPlateau stepped on each worker's own loss would); what step 2 says."""
    model, optimizer, _ = build(BY_KEY["canonical"])
    model, optimizer = parallax.distribute(
        model, optimizer, config=parallax.Config(partition_cache=None, collective_timeout_s=60))
    said = "trained"
    try:
        for step, (ids, y) in enumerate(batches(world, rank)):
            if step == 1:
                optimizer.param_groups[0]["lr"] = 0.05 * (rank + 1)
            optimizer.zero_grad()
            mse(model(ids), y).backward()
            optimizer.step()
    except parallax.UnsupportedProgramError as error:
        said = str(error)
    (out / f"lr-{rank}.txt").write_text(said)


def lr_per_rank_runner_program(out: Path, world: int, rank: int) -> None:
    """The same under `Runner.step`: the settings ride in the push (the embedding's model) or
    in their own all_to_all (a dense-only model: no push message); what step 2 says."""
    said = []
    for name, model in (("embedding", build(BY_KEY["canonical"])[0]),
                        ("dense", torch.nn.Linear(2, 3).double())):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        runner = parallax.get_runner(
            model, optimizer, mse,
            config=parallax.Config(partition_cache=None, collective_timeout_s=60))
        try:
            for step, (ids, y) in enumerate(batches(world, rank)):
                if step == 1:
                    optimizer.param_groups[0]["lr"] = 0.05 * (rank + 1)
                runner.step((ids if name == "embedding" else ids[:, :2].double(), y))
            said.append(f"{name}: trained")
        except parallax.UnsupportedProgramError as error:
            said.append(f"{name}: {error}")
    (out / f"lr-runner-{rank}.txt").write_text("\n".join(said))


def dense_sometimes_refused(out: Path, world: int, rank: int) -> None:
    """A dense layer used only in some steps, without Config(find_unused_parameters=True):
    what the next step's forward says on each rank."""
    habit = BY_KEY["dense_sometimes"]
    model, optimizer, extra = build(habit)
    model, optimizer = parallax.distribute(
        model, optimizer, config=parallax.Config(partition_cache=None, collective_timeout_s=60))
    said = "trained"
    try:
        habit.program(Run(model, optimizer, optimizer, batches(world, rank), world, rank,
                          extra))
    except parallax.UnsupportedProgramError as error:
        said = f"{error}\ncaused by: {error.__cause__}"
    (out / f"dense-sometimes-{rank}.txt").write_text(said)


def evaluate_on_rank0(out: Path, world: int, rank: int) -> None:
    """nanoGPT's habit: after a step, rank 0 alone evaluates under no_grad; what each rank
    says (on 26b56e5 rank 0 waited the whole collective timeout, then blamed rank 1)."""
    model, optimizer, _ = build(BY_KEY["canonical"])
    model, optimizer = parallax.distribute(
        model, optimizer, config=parallax.Config(partition_cache=None, collective_timeout_s=60))
    said = "trained"
    try:
        for ids, y in batches(world, rank):
            optimizer.zero_grad()
            mse(model(ids), y).backward()
            optimizer.step()
            if rank == 0:
                with torch.no_grad():
                    model(ids)
    except parallax.UnsupportedProgramError as error:
        said = str(error)
    (out / f"evaluate-rank0-{rank}.txt").write_text(said)


def rng_program(out: Path, rank: int) -> None:
    """What the program draws after distribute, and after one shuffled epoch."""
    model, optimizer, _ = build(BY_KEY["canonical"])
    torch.manual_seed(7)
    parallax.distribute(model, optimizer,
                        config=parallax.Config(partition_cache=None, collective_timeout_s=60))
    first = torch.rand(4)
    loader = parallax.shard(torch.utils.data.DataLoader(dataset(), batch_size=4, shuffle=True))
    seen = torch.cat([ids[:, 0] for ids, _ in loader])
    torch.save({"after_distribute": first, "after_epoch": torch.rand(4), "seen": seen},
               out / f"rng-{rank}.pt")


def main() -> None:
    out = Path(sys.argv[1])
    worker = current_worker()
    world, rank = worker.world_size, worker.rank
    ddp_program(out, world, rank)  # first: the program initialises the process group
    for habit in HABITS:
        if habit.launched:
            state = distributed(habit, world, rank)
            if rank == 0:
                torch.save(state, out / f"{habit.key}.pt")
    sampler_program(out, world, rank)
    load_differs_program(out, world, rank)
    sum_averaged_program(out, world, rank)
    rng_program(out, rank)
    lr_per_rank_program(out, world, rank)
    lr_per_rank_runner_program(out, world, rank)
    dense_sometimes_refused(out, world, rank)
    evaluate_on_rank0(out, world, rank)
    parallax.shutdown()


if __name__ == "__main__":
    main()
    exit_now()
