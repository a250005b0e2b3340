"""``schedule_original.py`` ported to parallax. ``--sized-before-shard`` sizes the schedule
from the loader before ``parallax.shard`` (``len`` of the whole loader: W times the worker's
steps), the port's own mistake that only a verify against the original shows."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from schedule_original import BATCH, EPOCHS, Net, data, train  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import parallax  # noqa: E402


def main() -> None:
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = DataLoader(data(), batch_size=BATCH)
    if "--sized-before-shard" in sys.argv:
        total = EPOCHS * len(loader)
        loader = parallax.shard(loader)
    else:
        loader = parallax.shard(loader)  # the README's port: len(loader) is the worker's
        total = EPOCHS * len(loader)
    model, optimizer = parallax.distribute(model, optimizer)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / total)
    train(model, optimizer, loader, schedule)


if __name__ == "__main__":
    main()
