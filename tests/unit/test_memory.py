"""The memory model (`parallax.planning.memory`): per-rank bytes by kind, from the optimizer's
own behaviour, against what a runner really holds."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import parallax
from parallax.planning.memory import MemoryEstimate, predict_memory, state_tensors_per_parameter


@pytest.mark.parametrize("make, expected", [
    (lambda p: torch.optim.SGD(p, lr=0.1), 0),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), 1),
    (lambda p: torch.optim.Adagrad(p, lr=0.1), 1),
    (lambda p: torch.optim.Adam(p, lr=0.1), 2),
    (lambda p: torch.optim.Adam(p, lr=0.1, amsgrad=True), 3),
    (lambda p: torch.optim.SparseAdam(p, lr=0.1), 2),
    (lambda p: torch.optim.RMSprop(p, lr=0.1, momentum=0.9, centered=True), 3),
])
def test_state_tensors_per_parameter_follow_the_optimizer(make, expected):
    assert state_tensors_per_parameter(make([nn.Parameter(torch.zeros(4, 5))])) == expected


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(1000, 16)
        self.head = nn.Linear(16, 4)
        self.register_buffer("scale", torch.ones(10))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(ids).mean(dim=1)) * self.scale[0]


def test_a_single_process_runner_holds_what_the_model_says():
    """One process: it is the only server (the whole table is its shard) and DDP is not used;
    Adam keeps two moments per element of every parameter."""
    torch.manual_seed(0)
    model = Model()
    model, optimizer = parallax.distribute(model, torch.optim.Adam(model.parameters(), lr=0.1),
                                           config=parallax.Config(partition_cache=None))
    try:
        estimate = model.runner.predicted_memory()
        table, dense = 1000 * 16 * 4, (16 * 4 + 4) * 4
        assert estimate == MemoryEstimate(parameters=table + dense,
                                          gradients=(1 + model.runner.layout.uses_ddp)
                                          * dense + table,
                                          optimizer_state=2 * (table + dense), buffers=40)
        # after a step the servers' and the optimizer's state are what was predicted
        ids = torch.randint(1000, (4, 3))
        optimizer.zero_grad()
        model(ids).sum().backward()
        optimizer.step()
        held = sum(t.nbytes for state in optimizer.state.values() for t in state.values()
                   if isinstance(t, torch.Tensor) and t.dim() > 0)
        shard = model.runner.layout.sparse["embedding.weight"]
        held += sum(t.nbytes for t in model.runner.shard_optimizer.table_state(shard).values()
                    if isinstance(t, torch.Tensor) and t.dim() > 0)
        assert held == estimate.optimizer_state
    finally:
        parallax.shutdown()


def test_a_replicated_model_counts_ddp_buckets():
    model = nn.Linear(10, 10)
    estimate = predict_memory(model, {}, {}, [torch.optim.SGD(model.parameters(), lr=0.1)],
                              uses_ddp=True)
    assert estimate == MemoryEstimate(parameters=440, gradients=880)


def test_a_table_built_as_usual_goes_before_its_optimizer_state_is_scattered(monkeypatch):
    """Rank 0 scatters the program's table, drops its copy, then scatters the state its
    optimizer made (Adagrad's constructor), which the program's optimizer no longer holds:
    at no time does the process hold the program's table, its state and both shards."""
    from parallax.engine.tables import handles, server_table

    torch.manual_seed(0)
    model = Model()
    table = model.embedding.weight
    seen = []
    scatter = server_table.ShardedTable.scatter_from_rank0

    def watched(self, weight):
        seen.append((handles.is_released(table), len(optimizer.state)))
        return scatter(self, weight)

    monkeypatch.setattr(server_table.ShardedTable, "scatter_from_rank0", watched)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)
    assert table in optimizer.state  # made by the constructor
    model, optimizer = parallax.distribute(model, optimizer,
                                           config=parallax.Config(partition_cache=None))
    try:
        # the values (table whole, all three states held), then Adagrad's sum: the table
        # released and its state gone from the program's optimizer (the dense two remain)
        assert seen == [(False, 3), (True, 2)]
    finally:
        parallax.shutdown()


def test_off_rank_0_the_programs_copy_goes_before_the_shard_is_made():
    from parallax.cluster import WorkerInfo
    from parallax.engine.tables.handles import is_released
    from parallax.planning.table_kinds import _drop_unread_copy

    for rank, dropped in ((0, False), (1, True), (3, True)):
        param = nn.Parameter(torch.zeros(5, 2))
        worker = WorkerInfo(rank=rank, world_size=4, local_rank=rank % 2, machine=rank // 2,
                            num_machines=2, machine_of_rank=(0, 0, 1, 1))
        _drop_unread_copy(param, "t", worker)
        assert is_released(param) is dropped and param.shape == (5, 2)
