"""Under a user's own ``torch.profiler.profile``, parallax's phases of a step are ranges of
its trace (``parallax: pull``, ``parallax: push``, ...), beside the user's operators; without
a profiler nothing is recorded (the phase clock's own timing is always on)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.profiler import ProfilerActivity, profile

import parallax
from parallax.engine.diagnostics.phases import PROFILER_PREFIX


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(50, 4)
        self.out = nn.Linear(4, 1)

    def forward(self, ids: Tensor) -> Tensor:
        return self.out(self.embedding(ids).mean(dim=1)).squeeze(1)


def test_a_users_profiler_trace_shows_parallaxs_phases(single_process, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _Model()
    runner = parallax.get_runner(model, torch.optim.Adagrad(model.parameters(), lr=0.1),
                                 nn.functional.mse_loss,
                                 config=parallax.Config(partition_cache=None))
    generator = torch.Generator().manual_seed(1)

    def batch() -> tuple[Tensor, Tensor]:
        return torch.randint(50, (8, 3), generator=generator), torch.rand(8, generator=generator)

    runner.step(batch())  # unprofiled: no range anywhere
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function("my training step"):
            runner.step(batch())
    names = {event.key for event in prof.key_averages()}
    ours = {name for name in names if name.startswith(PROFILER_PREFIX)}
    assert {"parallax: forward", "parallax: backward", "parallax: server update"} <= ours, ours
    assert "my training step" in names and "aten::embedding_bag" not in ours
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name") == "parallax: forward" for e in events)
    runner.step(batch())  # after the profiler: still steps, every phase closed
    assert runner.phases.running() == [] and runner.phases.steps == 3
