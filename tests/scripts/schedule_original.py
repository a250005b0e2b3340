"""A single-device program with a linear learning-rate decay sized from its loader
(``epochs * len(loader)``, as Hugging Face's examples size theirs): the original that
tests/integration/test_verify.py verifies ``schedule_port.py`` against."""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

EPOCHS, SAMPLES, BATCH = 2, 32, 4


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(30, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(ids).mean(dim=1)).squeeze(1)


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randint(0, 30, (SAMPLES, 3), generator=generator),
                         torch.rand(SAMPLES, generator=generator))


def train(model, optimizer, loader, schedule) -> None:
    for _ in range(EPOCHS):
        for ids, y in loader:
            optimizer.zero_grad()
            nn.functional.mse_loss(model(ids), y).backward()
            optimizer.step()
            schedule.step()


def main() -> None:
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = DataLoader(data(), batch_size=BATCH)
    total = EPOCHS * len(loader)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / total)
    train(model, optimizer, loader, schedule)


if __name__ == "__main__":
    main()
