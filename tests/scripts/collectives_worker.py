"""Worker of test_collectives.py, two parts of the exchange's CPU cost, saved to
OUT_DIR/rank<R>.pt:

- "sums": tensors of several sizes and dtypes summed over all ranks with
  `parallax.engine.tables.reduction.all_reduce`: per case the scheme taken, this rank's
  result, the exact float64 sum (and that of the magnitudes) and the bytes counted;
- "pulls": lookups of a server-held table (its rows scattered from rank 0 in many rounds,
  the other ranks passing a released copy, on meta) whose ids go with the count message
  (`parallax.engine.tables.reservations`), their counts per owner varying from step to step
  (none, steady, bursts past the reserved room): per step whether each lookup returned
  exactly the table's rows, how many all_to_alls the opening took, and the error every rank
  got for a bad id on rank 1.

Usage: parallax run --machines 2 --nproc-per-machine 2 collectives_worker.py OUT_DIR"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

import parallax
from parallax.cluster import WorkerInfo, current_worker
from parallax.engine import process_group
from parallax.engine.tables import reduction, server_table
from parallax.engine.tables.exchange import Traffic
from parallax.engine.tables.server_table import ShardedTable
from parallax.errors import SparseIdError
from parallax.launch.fast_exit import exit_now
from parallax.session import join

SIZES = {"tiny": 5, "small": 16_000, "large": 60_000}  # 64 KB of float32 is the bound at W=4


def sums(worker: WorkerInfo, group: dist.ProcessGroup) -> dict:
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
    return saved


ROWS = 500
# ids per lookup, step by step: consecutive ("steady": as many per owner every step) or random
COUNTS = [("steady", 0), ("steady", 60), ("steady", 60), ("steady", 60), ("random", 60),
          ("random", 300), ("random", 20), ("random", 20), ("random", 0), ("random", 400),
          ("random", 400), ("random", 10)]


def pulls(worker: WorkerInfo, group: dist.ProcessGroup) -> dict:
    weight = torch.randn(ROWS, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    # rank 0 scatters the rows in rounds of 1 KiB (12 of them) instead of 64 MiB
    server_table.SCATTER_ROUND_BYTES = 1024
    # off rank 0 the program's copy is released before the scatter (never read): a meta tensor
    mine = weight.clone() if worker.rank == 0 else torch.empty_like(weight, device="meta")
    table = ShardedTable("t", mine, num_partitions=3, worker=worker, group=group,
                         traffic=Traffic(worker.rank, worker.machine_of_rank),
                         sparse_grad=False, average=True)
    calls = 0
    original = process_group.all_to_all_single  # (the engine's way to the group)

    def counted(*args, **kwargs):
        nonlocal calls
        calls += 1
        return original(*args, **kwargs)

    exact, collectives = [], []
    generator = torch.Generator().manual_seed(100 + worker.rank)
    process_group.all_to_all_single = counted
    try:
        for step, (kind, count) in enumerate(COUNTS):
            # the ranks' counts differ: rank r looks up count * (r + 1) // 2 ids
            size = count * (worker.rank + 1) // 2
            ids = (torch.randint(ROWS, (size,), generator=generator) if kind == "random"
                   else (step * 7 + torch.arange(size)) % ROWS)
            before = calls
            with torch.no_grad():
                rows, inverse = table.lookup(ids)
            collectives.append(calls - before - 1)  # (the rows' way back is one more)
            exact.append(torch.equal(rows[inverse], weight[ids]))
        bad = torch.tensor([1, ROWS + 5 if worker.rank == 1 else 2])
        try:
            with torch.no_grad():
                table.lookup(bad)
            error = None
        except SparseIdError as raised:
            error = str(raised)
    finally:
        process_group.all_to_all_single = original
    return {"exact": exact, "collectives": collectives, "error": error}


def main() -> None:
    out = Path(sys.argv[1])
    worker = current_worker()
    group = join(worker, parallax.Config(collective_timeout_s=60))
    saved = {"sums": sums(worker, group), "pulls": pulls(worker, group)}
    torch.save(saved, out / f"rank{worker.rank}.pt")
    parallax.shutdown()
    exit_now(0)


if __name__ == "__main__":
    main()
