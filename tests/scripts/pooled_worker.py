"""Worker of test_pooled.py: EmbeddingBag tables pooled on their owners
(`Config.pooled_tables`), trained under parallax, every case's exported state_dict and the
bytes each table moved saved on rank 0 to OUT_DIR/train.pt (the planner's floor of rows'
bytes lowered, for the case where it decides), and a checkpoint of one case
written to OUT_DIR/ckpt after its first half (test_pooled.py resumes it on another shape).

Usage: parallax run ... pooled_worker.py OUT_DIR"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from pooled_cases import (  # noqa: E402
    CASES,
    RESUMED,
    RESUMED_BY_COLUMNS,
    RESUMED_BY_ROWS,
    batches,
    build,
    loss_fn,
    worker_slice,
)

import parallax  # noqa: E402
from parallax.engine.tables import server_table  # noqa: E402
from parallax.launch.fast_exit import exit_now  # noqa: E402
from parallax.planning import architectures  # noqa: E402
from parallax.step import plan_keeper  # noqa: E402

# these tables are tiny: the planner considers those whose rows move 1,500 B per machine and
# step (the history's 2,168; the user bags' 1,360 stay below)
architectures.MIN_POOLED_ROWS_BYTES = 1_500
# and moving a table onto its owner (the planner's choice) reads its rows in many rounds
server_table.SCATTER_ROUND_BYTES = 1024


# the cases checkpointed halfway, and where
FOLDERS = {RESUMED: "ckpt", RESUMED_BY_ROWS: "ckpt-by-rows",
           RESUMED_BY_COLUMNS: "ckpt-by-columns"}


def config(case) -> parallax.Config:
    return parallax.Config(pooled_tables=case.pooled, pooled_by_rows=case.by_rows,
                           pooled_by_columns=case.by_columns,
                           clip_grad_norm=case.clip,
                           sparsity_warmup_steps=2, partition_cache=None,
                           collective_timeout_s=60)


def train(out: Path) -> None:
    results = {}
    real_free_bytes = plan_keeper.free_bytes
    for case in CASES:
        plan_keeper.free_bytes = (real_free_bytes if case.free_bytes is None
                                  else lambda processes, free=case.free_bytes: free)
        model, optimizer = build(case, deferred=case.meta)
        runner = parallax.get_runner(model, optimizer, loss_fn, config=config(case))
        worker = runner.worker
        for step, batch in enumerate(batches(case), 1):
            if step == case.steps // 2 + 1 and case.name in FOLDERS:
                runner.save(out / FOLDERS[case.name])
            runner.step(worker_slice(case, batch, worker.rank, worker.world_size))
        moved = {name: dict(counts) for name, counts in runner.traffic.bytes.items()}
        state = runner.state_dict()
        if worker.rank == 0:
            results[case.name] = {
                "state": {k: v.detach().cpu().clone() for k, v in state.items()},
                "plan": runner.plan.table(), "bytes": moved}
    own_loop = own_loop_state(next(c for c in CASES if c.name == RESUMED_BY_COLUMNS))
    if worker.rank == 0:
        results[f"own loop: {RESUMED_BY_COLUMNS}"] = {"state": own_loop}
        torch.save(results, out / "train.pt")


def own_loop_state(case) -> dict:
    """``case`` trained through `parallax.distribute`, each worker's slice of a step in two
    halves, each pooled and backpropagated on its own (the owners sum both halves'
    gradients before the optimizer's step): the exported state (rank 0's)."""
    model, optimizer = build(case)
    model, optimizer = parallax.distribute(model, optimizer, config=config(case))
    rank, world = dist.get_rank(), dist.get_world_size()
    for batch in batches(case):
        optimizer.zero_grad()
        for half in range(2):
            args, targets = worker_slice(case, batch, 2 * rank + half, 2 * world)
            (loss_fn(model(*args), targets) / 2).backward()
        optimizer.step()
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def main() -> None:
    train(Path(sys.argv[1]))
    parallax.shutdown()
    exit_now()


if __name__ == "__main__":
    main()
