"""Worker of test_reduction.py: sums tensors of several sizes and dtypes over all ranks with
`parallax.engine.tables.reduction.all_reduce` and saves, per case, the scheme taken, this
rank's result, the exact float64 sum (and that of the magnitudes) and the bytes the
accounting recorded, to OUT_DIR/rank<R>.pt.

Usage: parallax run --machines 2 --nproc-per-machine 2 reduction_worker.py OUT_DIR"""

import sys
from pathlib import Path

import torch

import parallax
from parallax.cluster import current_worker
from parallax.engine.tables import reduction
from parallax.engine.tables.exchange import Traffic
from parallax.launch.fast_exit import exit_now
from parallax.session import join

SIZES = {"tiny": 5, "small": 16_000, "large": 60_000}  # 64 KB of float32 is the bound at W=4


def main() -> None:
    out = Path(sys.argv[1])
    worker = current_worker()
    group = join(worker, parallax.Config(collective_timeout_s=60))
    saved = {}
    for label, size in SIZES.items():
        for dtype in (torch.float32, torch.float64):
            # each rank its own values, far apart in magnitude: the order of the sum matters
            generator = torch.Generator().manual_seed(worker.rank)
            mine = torch.randn(size, generator=generator, dtype=torch.float64)
            mine *= 10.0 ** (3 * worker.rank)
            exact, bound = mine.clone(), mine.abs()
            torch.distributed.all_reduce(exact, group=group)
            torch.distributed.all_reduce(bound, group=group)
            tensor = mine.to(dtype)
            traffic = Traffic(worker.rank, worker.machine_of_rank)
            by_all_to_all = reduction.by_all_to_all(tensor, group)
            reduction.account(tensor, traffic=traffic, name="t", all_to_all=by_all_to_all)
            reduction.all_reduce(tensor, group, all_to_all=by_all_to_all)
            saved[f"{label}-{str(dtype)[6:]}"] = {
                "by_all_to_all": by_all_to_all, "sum": tensor, "exact": exact, "bound": bound,
                "bytes": dict(traffic.bytes["t"])}
    torch.save(saved, out / f"rank{worker.rank}.pt")
    parallax.shutdown()
    exit_now(0)


if __name__ == "__main__":
    main()
