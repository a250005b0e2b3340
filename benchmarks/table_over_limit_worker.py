"""One worker of `table_over_limit.py`: trains an embedding model whose table is larger than
this process may hold (RLIMIT_DATA), with parallax (built in ``parallax.meta_init``) or with
plain DDP (every worker builds the whole table, as DDP needs).

    python -m parallax.cli run --machines 4 --nproc-per-machine 1 \\
        benchmarks/table_over_limit_worker.py MODE LIMIT_BYTES ROWS DIM STEPS OUT_DIR

MODE is ``parallax`` or ``ddp``. Each rank writes ``OUT_DIR/rank<R>.json``: its peak resident
memory (VmHWM) after training and after the export, and the losses; under parallax the
trained model is exported, streamed, to ``OUT_DIR/model.pt``.
"""

from __future__ import annotations

import json
import os
import re
import resource
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import parallax
from parallax.launch.fast_exit import exit_now


class Model(nn.Module):
    def __init__(self, rows: int, dim: int):
        super().__init__()
        self.embedding = nn.Embedding(rows, dim, sparse=True)
        self.head = nn.Linear(dim, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(ids).mean(dim=1))


def status_mib(field: str) -> float:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1)) / 1024


def main() -> None:
    mode, limit, rows, dim, steps, out_dir = sys.argv[1:7]
    limit, rows, dim, steps = int(limit), int(rows), int(dim), int(steps)
    # The per-process memory limit: private writable memory (heap and anonymous maps).
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    torch.manual_seed(0)
    if mode == "parallax":
        with parallax.meta_init():
            model = Model(rows, dim)
        net, optimizer = parallax.distribute(
            model, torch.optim.SGD(model.parameters(), lr=0.1),
            config=parallax.Config(partition_cache=None))
        rank = int(os.environ["RANK"])
    else:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        model = Model(rows, dim)  # the whole table: what DDP replicates
        net = nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(steps):
        ids = torch.randint(rows, (32, 8), generator=generator)
        target = torch.randint(8, (32,), generator=generator)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(net(ids), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    record = {"rank": rank, "mode": mode, "peak_rss_mib": status_mib("VmHWM"),
              "limit_mib": limit / 2**20, "table_mib": rows * dim * 4 / 2**20,
              "losses": losses}
    if mode == "parallax":
        # the trained model as one plain state_dict file, streamed (no whole table anywhere)
        net.runner.export(Path(out_dir, "model.pt"))
        record["peak_rss_mib_after_export"] = status_mib("VmHWM")
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))
    if mode == "parallax":
        parallax.shutdown()
    else:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now()  # parallax.launch.fast_exit: no second of teardown per worker
