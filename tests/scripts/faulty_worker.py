"""A training program that goes wrong on purpose, for the error-path tests.

Usage: faulty_worker.py MODE OUT_DIR, MODE one of
  bad_id   rank 1's batch holds an embedding id outside the table
  raise    rank 1 raises in its 3rd step while the others wait in collectives
  lbfgs    the optimizer cannot be applied per shard
  mismatch rank 1 builds another Config and model head than rank 0
  nan      rank 1's loss is NaN in step 3 (nan-skip: with Config(nonfinite="skip"))
  export   no fault: train, export, and check the export reproduces the runner's outputs
  uneven   rank 1 has one batch more than the others (collective timeout 60 s)
  hang     rank 1 sleeps 120 s in its loop before step 4 (collective timeout 10 s)
  hang-loss  rank 1 sleeps 120 s in its loss function in step 4 (collective timeout 10 s)
  raise-async  as raise, under Config(sync="async") (no collective holds the others)
  hang-async   as hang, under Config(sync="async", max_staleness=1): rank 0's staleness wait
Every worker writes OUT_DIR/pid-RANK so the test can check no process is left behind.
"""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from equivalence_cases import Case, Mixed, global_batches, loss_fn, worker_slice  # noqa: E402

import parallax  # noqa: E402
from parallax.cluster import current_worker  # noqa: E402
from parallax.launch.fast_exit import exit_now  # noqa: E402


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    worker = current_worker()
    (out / f"pid-{worker.rank}").write_text(str(os.getpid()))
    torch.manual_seed(0)
    model = Mixed()
    if mode == "lbfgs":
        optimizer = torch.optim.LBFGS(model.parameters())
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    config = parallax.Config(collective_timeout_s=60)
    if mode == "mismatch" and worker.rank == 1:
        config = parallax.Config(collective_timeout_s=60, clip_grad_norm=1.0)
        model.out = torch.nn.Linear(10, 5)  # a different head: another model signature
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)  # over that model
        parallax.partition(model.embedding, name="tables")  # and a partition group
    poisoned = [False]
    stalled = [False]

    def loss(output, target):  # NaN on rank 1 alone, in mode nan/nan-skip, step 3
        value = loss_fn(output, target)
        if stalled[0]:
            time.sleep(120)
        return value * float("nan") if poisoned[0] else value

    if mode == "nan-skip":
        config = parallax.Config(collective_timeout_s=60, nonfinite="skip")
    if mode == "uneven":  # (60 s: a run that waited for it is told from one that did not)
        config = parallax.Config(collective_timeout_s=60)
    if mode in ("hang", "hang-loss"):  # 8 s: as the async hang's, proven on 2 loaded cores
        config = parallax.Config(collective_timeout_s=8)
    if mode.endswith("-async"):
        config = parallax.Config(collective_timeout_s=8 if mode == "hang-async" else 60,
                                 sync="async", architecture="ps",
                                 max_staleness=1 if mode == "hang-async" else None)
    runner = parallax.get_runner(model, optimizer, loss, config=config)
    batches = global_batches(Case("mixed", "adam"))
    if mode == "uneven" and worker.rank != 1:
        batches = batches[:3]
    for step, batch in enumerate(batches):
        if mode in ("hang", "hang-async") and worker.rank == 1 and step == 3:
            time.sleep(120)
        x, y = worker_slice(batch, worker.rank, worker.world_size)
        poisoned[0] = mode.startswith("nan") and worker.rank == 1 and step == 2
        stalled[0] = mode == "hang-loss" and worker.rank == 1 and step == 3
        if mode == "bad_id" and worker.rank == 1 and step == 2:
            x = x.clone()
            x[0, 0] = 123_456
        if mode in ("raise", "raise-async") and worker.rank == 1 and step == 2:
            raise RuntimeError("deliberate failure in the user's training loop")
        runner.step((x, y))
    if mode == "nan-skip":
        (out / f"skipped-{worker.rank}").write_text(str(runner.skipped_steps))
    if mode == "export":
        probe = torch.randint(0, 40, (16, 5), generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            distributed = runner.forward(probe)
        state = runner.state_dict()
        if worker.rank == 0:
            fresh = Mixed()
            fresh.load_state_dict(state)  # strict: same keys, same shapes
            with torch.no_grad():
                single = fresh(probe)
            torch.save({"distributed": distributed, "single": single}, out / "export.pt")
    parallax.shutdown()


if __name__ == "__main__":
    main()
    exit_now()
