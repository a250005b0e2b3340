"""Worker of test_embedding_options.py: trains the max_norm model with replicated tables and
saves, per step, this rank's replica of every replicated table to OUT_DIR/rank<R>.pt.

Usage: parallax run ... replica_worker.py OUT_DIR"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from equivalence_cases import Case, MaxNormed, global_batches, loss_fn, worker_slice  # noqa: E402

import parallax  # noqa: E402
from parallax.engine.tables.replicated import ReplicatedTable  # noqa: E402
from parallax.launch.fast_exit import exit_now  # noqa: E402


def main() -> None:
    out = Path(sys.argv[1])
    settings = {"allreduce": dict(architecture="allreduce"),
                "hybrid-migrated": dict(alpha_threshold=0.0, sparsity_warmup_steps=2)}
    saved = {}
    for setting, options in settings.items():
        torch.manual_seed(0)
        model = MaxNormed().double()
        # Larger rows than max_norm: every lookup renormalises.
        with torch.no_grad():
            model.embedding.weight.mul_(3)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
        runner = parallax.get_runner(model, optimizer, loss_fn, config=parallax.Config(
            collective_timeout_s=60, **options))
        worker = runner.worker
        steps = []
        for batch in global_batches(Case("maxnorm", "adam", steps=10, seed=3)):
            runner.step(worker_slice(batch, worker.rank, worker.world_size))
            steps.append({name: table.param.detach().clone()
                          for name, table in runner.tables.items()
                          if isinstance(table, ReplicatedTable)})
        saved[setting] = [step for step in steps if step]  # the hybrid: after moving
    torch.save(saved, out / f"rank{worker.rank}.pt")
    parallax.shutdown()


if __name__ == "__main__":
    main()
    exit_now()
