"""Worker of the partition-search tests: an embedding model built inside
``parallax.partitioner()``, trained STEPS steps; rank 0 writes how each group's count was chosen.

Usage: parallax run|plan ... search_worker.py CACHE.json OUT.json"""

import json
import sys

import torch
from torch import nn

import parallax
from parallax.launch.fast_exit import exit_now

STEPS = 16


def main() -> None:
    cache, out = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    with parallax.partitioner("embeddings", max_partitions=8):
        embedding = nn.Embedding(500, 16)
    model = nn.Sequential(embedding, nn.Flatten(), nn.Linear(64, 1))
    config = parallax.Config(sparsity_warmup_steps=2, partition_search_steps=2,
                             partition_cache=cache)
    runner = parallax.get_runner(model, torch.optim.Adagrad(model.parameters(), lr=0.1),
                                 nn.functional.mse_loss, config=config)
    generator = torch.Generator().manual_seed(runner.worker.rank)
    for _ in range(STEPS):
        runner.step((torch.randint(500, (8, 4), generator=generator), torch.rand(8, 1)))
    if runner.worker.rank == 0:
        with open(out, "w") as file:
            json.dump({name: record.to_dict()
                       for name, record in runner.partition_searches.items()}, file)
    parallax.shutdown()


if __name__ == "__main__":
    main()
    exit_now()
