"""The user's own training loop under `parallax.distribute`, for the integration tests.

Usage: own_loop_worker.py MODE OUT_DIR, MODE one of
  outputs    train 4 steps of the canonical loop; save every step's model outputs for this
             worker's slice (OUT_DIR/outputs-RANK.pt) and, on rank 0, the final model and
             optimizer state dicts
  skip-step  rank 1 does not call optimizer.step() in step 3 (collective timeout 20 s)
  save-on-0  rank 0 alone calls model.state_dict() after step 2, as DDP programs do
Every worker writes OUT_DIR/pid-RANK so the test can check no process is left behind.
"""

import os
import sys
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
    model = Mixed().double()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    config = parallax.Config(collective_timeout_s=60 if mode == "outputs" else 20,
                             partition_cache=None)
    model, optimizer = parallax.distribute(model, optimizer, config=config)
    outputs = []
    for step, batch in enumerate(global_batches(Case("mixed", "adam", steps=4)), 1):
        x, y = worker_slice(batch, worker.rank, worker.world_size)
        optimizer.zero_grad()
        output = model(x)
        outputs.append(output.detach().clone())
        loss_fn(output, y).backward()
        if mode == "skip-step" and worker.rank == 1 and step == 3:
            continue
        optimizer.step()
        if mode == "save-on-0" and worker.rank == 0 and step == 2:
            torch.save(model.state_dict(), out / "state.pt")
    torch.save(outputs, out / f"outputs-{worker.rank}.pt")
    state = model.state_dict()
    optimizer_state = optimizer.state_dict()  # collective too: the servers' moments gathered
    if worker.rank == 0:
        torch.save(state, out / "state.pt")
        torch.save(optimizer_state, out / "optimizer.pt")
    parallax.shutdown()


if __name__ == "__main__":
    main()
    exit_now()
