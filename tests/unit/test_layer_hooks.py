"""Forward hooks on a table's layer run as on one device: the stand-in that reads the table
holds the layer's own hook dicts, so a hook registered before or after `parallax.distribute`
sees each lookup, and one that changes the output changes what the model computes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import parallax


class _Bags(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(30, 4)
        self.bag = nn.EmbeddingBag(20, 4, mode="sum")
        self.out = nn.Linear(16, 1)

    def forward(self, ids: torch.Tensor, bags: torch.Tensor) -> torch.Tensor:
        return self.out(torch.cat([self.emb(ids).flatten(1), self.bag(bags)], dim=1))


def _hooked(model: _Bags, seen: list[str]) -> None:
    model.emb.register_forward_hook(lambda module, args, out: seen.append("emb") or out * 2)
    model.bag.register_forward_pre_hook(lambda module, args: seen.append("bag") or None)


@pytest.mark.parametrize("warmup", [50, 2], ids=["executed copy", "program's own module"])
def test_a_hook_on_a_tables_layer_runs_and_changes_the_output_as_on_one_device(
        single_process, warmup: int) -> None:
    torch.manual_seed(0)
    mine, plain = _Bags().double(), _Bags().double()
    plain.load_state_dict(mine.state_dict())
    mine_seen: list[str] = []
    plain_seen: list[str] = []
    mine.emb.register_forward_hook(lambda module, args, out: out + 1)  # before distribute
    plain.emb.register_forward_hook(lambda module, args, out: out + 1)
    model, opt = parallax.distribute(mine, torch.optim.SGD(mine.parameters(), lr=0.1),
                                     config=parallax.Config(sparsity_warmup_steps=warmup,
                                                            partition_cache=None))
    _hooked(mine, mine_seen)  # after distribute
    _hooked(plain, plain_seen)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    try:
        for _ in range(5):
            ids = torch.randint(30, (5, 3), generator=generator)
            bags = torch.randint(20, (5, 2), generator=generator)
            target = torch.rand(5, 1, generator=generator, dtype=torch.float64)
            for net, optimizer in ((model, opt), (plain, plain_opt)):
                optimizer.zero_grad()
                nn.functional.mse_loss(net(ids, bags), target).backward()
                optimizer.step()
        assert mine_seen == plain_seen == ["emb", "bag"] * 5
        for (name, ours), theirs in zip(model.state_dict().items(),
                                        plain.state_dict().values(), strict=True):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-9, msg=name)
    finally:
        parallax.shutdown()
