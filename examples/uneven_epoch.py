"""A divergence `parallax verify` finds: a recommender whose epoch does not divide among the
workers.

An ordinary single-device loop (EmbeddingBag over each user's recent items, an item
embedding, an MLP; Adagrad) on 101 synthetic ratings, ported with the two parallax lines.
On 2 workers ``DistributedSampler`` (under ``parallax.shard``, as under DDP) pads each epoch
to a multiple of 2 samples: the epoch's last step trains on a repeated sample that one device
never sees. Every other step is exact, so the difference starts at that step:

    parallax verify --steps 10 examples/uneven_epoch.py               # exit 1: step 7
    parallax verify --steps 10 examples/uneven_epoch.py --drop-last   # exit 0

``--drop-last`` (``DataLoader(drop_last=True)``) drops the partial batch on every worker,
and the one process drops the same samples: equal. So does a sample count the workers
divide.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import parallax


class Recommender(nn.Module):
    def __init__(self, users: int, items: int, dim: int = 8) -> None:
        super().__init__()
        self.history = nn.EmbeddingBag(items, dim, mode="mean")
        self.user = nn.Embedding(users, dim)
        self.item = nn.Embedding(items, dim)
        self.mlp = nn.Sequential(nn.Linear(3 * dim, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, user: Tensor, item: Tensor, recent: Tensor) -> Tensor:
        features = torch.cat([self.user(user), self.item(item), self.history(recent)], dim=1)
        return self.mlp(features).squeeze(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=101)
    parser.add_argument("--batch-size", type=int, default=8, help="per worker")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--drop-last", action="store_true")
    args = parser.parse_args()

    torch.manual_seed(0)
    users, items = 50, 40
    data = TensorDataset(torch.randint(0, users, (args.samples,)),
                         torch.randint(0, items, (args.samples,)),
                         torch.randint(0, items, (args.samples, 5)),
                         torch.rand(args.samples) * 5)
    model = Recommender(users, items)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)
    model, optimizer = parallax.distribute(model, optimizer)  # parallax
    loader = parallax.shard(DataLoader(data, batch_size=args.batch_size, shuffle=True,  # parallax
                                       drop_last=args.drop_last))
    for epoch in range(args.epochs):
        for user, item, recent, rating in loader:
            optimizer.zero_grad()
            loss = F.mse_loss(model(user, item, recent), rating)
            loss.backward()
            optimizer.step()
        print(f"epoch {epoch}: last loss {float(loss):.4f}", flush=True)
    parallax.shutdown()


if __name__ == "__main__":
    main()
