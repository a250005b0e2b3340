"""α is measured over the warm-up steps only: afterwards the tables stop counting their use
(`Table.measuring`), so that a long run neither pays for the counting (a ``torch.unique`` of
every lookup's ids per step) nor keeps a list that grows every step."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import parallax


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(40, 4, mode="sum")
        self.embedding = nn.Embedding(40, 4)
        self.out = nn.Linear(4, 1)

    def forward(self, ids: Tensor) -> Tensor:
        return self.out(self.bag(ids) + self.embedding(ids).mean(dim=1)).squeeze(1)


@pytest.mark.parametrize("warmup", [0, 2])
def test_use_is_counted_over_the_warmup_only(single_process, warmup: int) -> None:
    torch.manual_seed(0)
    model = _Model()
    runner = parallax.get_runner(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                 nn.functional.mse_loss, config=parallax.Config(
                                     sparsity_warmup_steps=warmup, partition_cache=None))
    generator = torch.Generator().manual_seed(1)
    for step in range(1, 6):
        runner.step((torch.randint(40, (6, 3), generator=generator),
                     torch.rand(6, generator=generator)))
        for table in runner.layout.sparse.values():
            counted = min(step, warmup)
            assert len(table.rows_used) == counted and table.measuring == (step < warmup)
            if table.name == "bag.weight":
                assert table.bag_use.bags == 6 * counted
    if warmup:
        assert all(p.alpha is not None and p.alpha > 0 for p in runner.plan.parameters
                   if p.sparse)
    parallax.shutdown()
