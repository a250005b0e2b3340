"""Worker of the phase-timing tests: a model with an embedding (pulled from the servers, ids
read ahead of the forward) and a dense head (AllReduced by the hierarchical hook), clipping on
and a checkpoint every 2 steps, so that a step runs every phase. Writes, per rank,
``runner.stats()["step phases"]`` to OUT_DIR/phases-RANK.json.

Usage: parallax run --timeline FILE --machines 2 --nproc-per-machine 2 timeline_worker.py OUT_DIR"""

import json
import sys
from pathlib import Path

import torch
from torch import nn

import parallax
from parallax.launch.fast_exit import exit_now

STEPS = 4
# steps of ~200 ms or more: a few milliseconds of scheduling noise between two phases (4
# processes on 2 cores) stay well inside the coverage test's 10 %
BATCH = 2048


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(1000, 16)
        self.bag = nn.EmbeddingBag(1000, 16)  # pooled on its owner: the "pool" phase
        self.head = nn.Sequential(nn.Linear(16, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(),
                                  nn.Linear(512, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(ids).mean(dim=1) + self.bag(ids)).squeeze(1)


def main() -> None:
    out = Path(sys.argv[1])
    torch.manual_seed(0)
    model = Model()
    config = parallax.Config(clip_grad_norm=1.0, checkpoint_dir=str(out / "checkpoints"),
                             checkpoint_every_steps=2, partition_cache=None,
                             pooled_tables=("bag.weight",))
    runner = parallax.get_runner(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                 nn.functional.mse_loss, config=config)
    generator = torch.Generator().manual_seed(runner.worker.rank)
    for _ in range(STEPS):
        runner.step((torch.randint(1000, (BATCH, 8), generator=generator),
                     torch.rand(BATCH, generator=generator)))
    (out / f"phases-{runner.worker.rank}.json").write_text(
        json.dumps(runner.stats()["step phases"]))
    parallax.shutdown()


if __name__ == "__main__":
    main()
    exit_now()
