"""`parallax.model.detect.tracing_once`: inside the block the model is traced once for every
reader of its trace; outside, each reader traces; a model that cannot be traced fails every
reader alike (each falls back as it does alone)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from parallax.model.detect import batch_dependent_reads, find_sparse_parameters, tracing_once

pytestmark = pytest.mark.unit


class Counted(nn.Module):
    """Counts the times its forward's Python runs (each trace runs it once), in a list: what
    a trace writes on the module itself is undone after it (`parallax.model.trace_reads`)."""

    def __init__(self, traceable: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4, max_norm=1.0)
        self.w = nn.Parameter(torch.randn(10, 4))
        self.runs: list[int] = []
        self.traceable = traceable

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.runs.append(1)
        out = self.emb(ids) + self.w[ids]
        if not self.traceable and out.sum() > 0:  # data-dependent: no trace
            return out
        return out


def test_one_trace_serves_both_readers_inside_the_block() -> None:
    model = Counted()
    with tracing_once(model):
        uses = find_sparse_parameters(model)
        reads = batch_dependent_reads(model)
    assert len(model.runs) == 1
    assert set(uses) == {"emb.weight", "w"} and uses["w"].kind == "gather"
    assert reads["emb.weight"][1].max_norm == 1.0
    # the same answers as without the block, which traces for each
    assert find_sparse_parameters(model) == uses and batch_dependent_reads(model) == reads
    assert len(model.runs) == 3


def test_a_model_that_cannot_be_traced_fails_each_reader_alike() -> None:
    model = Counted(traceable=False)
    with tracing_once(model):
        uses = find_sparse_parameters(model)  # the module rule only
        reads = batch_dependent_reads(model)  # the modules' options only
    assert len(model.runs) == 1
    assert set(uses) == {"emb.weight"}
    assert reads["emb.weight"][1].max_norm == 1.0


class UpdatesBuffers(nn.Module):
    """A forward that updates its buffers: in place by numbers (a trace would run that for
    real), in place by the batch, and by reassignment (a trace would leave an fx Proxy)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.register_buffer("steps", torch.ones((), dtype=torch.long))
        self.register_buffer("avg", torch.ones(4))
        self.register_buffer("last", torch.zeros(4))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.emb(ids)
        self.steps += 1
        self.avg.mul_(0.9).add_(rows.detach().mean(0), alpha=0.1)
        self.last = rows.detach().mean(0)
        return rows - self.avg


def test_a_trace_leaves_the_models_buffers_as_they_were() -> None:
    model = UpdatesBuffers()
    before = {name: (buffer, buffer.clone()) for name, buffer in model.named_buffers()}
    assert set(find_sparse_parameters(model)) == {"emb.weight"}
    for name, buffer in model.named_buffers():
        assert buffer is before[name][0], name
        assert torch.equal(buffer, before[name][1]), name
