"""Worker of test_pooled.py: EmbeddingBag tables pooled on their owners
(`Config.pooled_tables`), trained under parallax, every case's exported state_dict and the
bytes each table moved saved on rank 0 to OUT_DIR/train.pt, and a checkpoint of one case
written to OUT_DIR/ckpt after its first half.

``resume`` (run on another cluster shape): loads that checkpoint and trains the second half,
saving OUT_DIR/resumed.pt.

Usage: parallax run ... pooled_worker.py OUT_DIR train|resume"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from pooled_cases import CASES, RESUMED, batches, build, loss_fn, worker_slice  # noqa: E402

import parallax  # noqa: E402
from parallax.launch.fast_exit import exit_now  # noqa: E402


def config(case, checkpoint_dir=None) -> parallax.Config:
    return parallax.Config(pooled_tables=case.pooled, clip_grad_norm=case.clip,
                           sparsity_warmup_steps=2, partition_cache=None,
                           checkpoint_dir=checkpoint_dir, resume=False,
                           collective_timeout_s=60)


def train(out: Path) -> None:
    results = {}
    for case in CASES:
        model, optimizer = build(case)
        runner = parallax.get_runner(model, optimizer, loss_fn, config=config(case))
        worker = runner.worker
        for step, batch in enumerate(batches(case), 1):
            if case.name == RESUMED and step == case.steps // 2 + 1:
                runner.save(out / "ckpt")
            runner.step(worker_slice(case, batch, worker.rank, worker.world_size))
        moved = {name: dict(counts) for name, counts in runner.traffic.bytes.items()}
        state = runner.state_dict()
        if worker.rank == 0:
            results[case.name] = {
                "state": {k: v.detach().clone() for k, v in state.items()},
                "plan": runner.plan.table(), "bytes": moved}
    if worker.rank == 0:
        torch.save(results, out / "train.pt")


def resume(out: Path) -> None:
    case = next(c for c in CASES if c.name == RESUMED)
    model, optimizer = build(case)
    runner = parallax.get_runner(model, optimizer, loss_fn, config=config(case))
    runner.load(out / "ckpt")
    worker = runner.worker
    for batch in batches(case)[case.steps // 2:]:
        runner.step(worker_slice(case, batch, worker.rank, worker.world_size))
    state = runner.state_dict()
    if worker.rank == 0:
        torch.save({k: v.detach().clone() for k, v in state.items()}, out / "resumed.pt")


def main() -> None:
    out, what = Path(sys.argv[1]), sys.argv[2]
    train(out) if what == "train" else resume(out)
    parallax.shutdown()
    exit_now()


if __name__ == "__main__":
    main()
