"""A program built on the CPU and trained on a GPU (marked ``gpu``: skipped without CUDA, run by
``scripts/gpu_check.sh``): `place_on_device` moves the model, and the optimizer state its
constructor already made (Adagrad's sums) follows the parameters, as torch's own
``Optimizer.load_state_dict`` places it (a non-capturable ``step`` count stays on the CPU)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from parallax.engine.tables.verdict import Verdict
from parallax.model.meta_init import place_on_device

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _program() -> tuple[nn.Module, list[torch.optim.Optimizer]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 3)).double()
    return model, [torch.optim.Adagrad(model[0].parameters(), lr=0.1,
                                       initial_accumulator_value=0.5),
                   torch.optim.Adam(model[1].parameters(), lr=0.01)]


def _train(model: nn.Module, optimizers: list[torch.optim.Optimizer],
           device: torch.device) -> dict[str, torch.Tensor]:
    ids = torch.arange(12).remainder(7).view(4, 3)
    for _ in range(3):
        for optimizer in optimizers:
            optimizer.zero_grad()
        model(ids.to(device)).pow(2).sum().backward()
        for optimizer in optimizers:
            optimizer.step()
    return {k: v.cpu() for k, v in model.state_dict().items()}


def test_constructor_state_follows_the_model_to_the_gpu() -> None:
    cuda = torch.device("cuda", 0)
    model, optimizers = _program()
    place_on_device(model, (), optimizers, cuda)
    sums = optimizers[0].state[model[0].weight]
    assert sums["sum"].device == cuda and sums["step"].device.type == "cpu"
    got = _train(model, optimizers, cuda)
    want = _train(*_program(), torch.device("cpu"))
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-12, atol=1e-12)


def test_the_verdict_is_prepared_without_waiting_for_the_gpu() -> None:
    """What the host knows goes to the GPU in a copy that does not synchronise the stream."""
    cuda = torch.device("cuda", 0)
    loss = torch.tensor(2.0, device=cuda)
    verdict = Verdict(loss=loss)
    bound = torch.ones((), dtype=torch.float64, device=cuda)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        verdict.prepare(names=["a", "b"], reached=[True, False], stale=0, bound=bound,
                        limit=10.0, world=2)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert verdict.waiting is not None
    verdict.receive(verdict.waiting)
    assert verdict.finite() and verdict.reached().tolist() == [2.0, 0.0]
