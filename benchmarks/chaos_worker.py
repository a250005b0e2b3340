"""Worker of benchmarks/chaos.py: a small recommender-like program (an EmbeddingBag and an
MLP, float64, Adagrad) trained under parallax with checkpoints, so that faults planted at
random moments can be checked against an uninterrupted run.

Usage (under ``parallax run``): chaos_worker.py OUT_DIR JSON_OPTIONS. Options: ``steps``,
``checkpoint_every``, ``timeout_s`` (Config.collective_timeout_s), ``sync`` (an asynchronous
one with ``max_staleness=0``: equal to ``sync``), ``step_sleep_s`` (a pause inside every
step's loss, so that a step lasts long enough for a fault to land in it),
``checkpoint_dir``, ``search`` (the partition count searched while training: re-partitioning
in the first steps), ``local_aggregation`` (Config.local_aggregation=True), ``save_pause_s``
(each checkpoint file written that long after ``OUT_DIR/saving-<rank>`` is touched: a save the
harness can interrupt). Each batch is a
function of the global step alone, so a resumed run sees the batches the uninterrupted one
saw. Every process writes ``OUT_DIR/pid-<rank>-<pid>`` (the harness checks none is left
behind) and, each step, ``OUT_DIR/step-<rank>`` (the harness times its faults by it); rank 0
writes ``OUT_DIR/final.pt``, the exported parameters.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

import parallax
from parallax.cluster import current_worker
from parallax.launch.fast_exit import exit_now

VOCAB, DIM, BAGS, BAG_SIZE = 5_000, 16, 16, 8  # per worker and step


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(VOCAB, DIM, mode="sum")
        self.mlp = nn.Sequential(nn.Linear(DIM, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.bag(ids)).squeeze(1)


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of global batch ``step`` (the same whatever ran before)."""
    generator = torch.Generator().manual_seed(10_000 + step)
    ids = torch.randint(VOCAB, (BAGS * world, BAG_SIZE), generator=generator)
    target = torch.rand(BAGS * world, dtype=torch.float64, generator=generator)
    mine = slice(rank * BAGS, (rank + 1) * BAGS)
    return ids[mine], target[mine]


def _slow_saves(marker: Path, pause: float) -> None:
    """Each checkpoint file written ``pause`` seconds after ``marker`` is touched, so that
    the harness can kill a rank in the middle of a save (a save of this model is otherwise
    over in milliseconds)."""
    from parallax.checkpoint import sharded

    original = sharded.save_object

    def slow(path: Path, obj: object):  # type: ignore[no-untyped-def]
        marker.write_text(str(path))
        time.sleep(pause)
        return original(path, obj)

    sharded.save_object = slow


def main() -> None:
    out, options = Path(sys.argv[1]), json.loads(sys.argv[2])
    worker = current_worker()
    assert worker is not None, "run under parallax run or torchrun"
    (out / f"pid-{worker.rank}-{os.getpid()}").write_text("")
    torch.manual_seed(0)
    model = Model().double()
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.05)
    sleep = float(options.get("step_sleep_s", 0.0))
    if options.get("search"):  # the partition count searched in the first steps
        parallax.partition(model, max_partitions=4)

    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        time.sleep(sleep)  # the step's "compute": faults land inside steps, not only between
        return nn.functional.mse_loss(output, target)

    if options.get("save_pause_s"):
        _slow_saves(out / f"saving-{worker.rank}", float(options["save_pause_s"]))
    config = parallax.Config(
        checkpoint_dir=options["checkpoint_dir"],
        checkpoint_every_steps=options["checkpoint_every"],
        collective_timeout_s=options["timeout_s"], sync=options.get("sync", "sync"),
        max_staleness=0 if options.get("sync", "sync") != "sync" else None,
        local_aggregation=options.get("local_aggregation") or None,
        partition_cache=None)  # every run searches: no count remembered from an earlier one
    runner = parallax.get_runner(model, optimizer, loss, config=config)
    progress = out / f"step-{worker.rank}"
    while runner.global_step < options["steps"]:
        runner.step(batch(runner.global_step, worker.rank, worker.world_size))
        progress.write_text(str(runner.global_step))
    if runner.export(out / "final.tmp") is not None:  # collective; rank 0 writes
        (out / "final.tmp").replace(out / "final.pt")
    parallax.shutdown()
    exit_now()


if __name__ == "__main__":
    main()
