"""Replicated sparse parameters (`parallax.engine.tables.replicated.ReplicatedTable`) in a world of
one: lookups read the local replica, and after `push_gradients` the replica's gradient must be
the single-device gradient of the same lookups, in both sync modes (AllGatherv of (ids, rows)
and AllReduce of the dense gradient)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from table_steps import lookup_step, reference_grad
from torch import Tensor, nn

from parallax.cluster import WorkerInfo
from parallax.engine.tables.exchange import Traffic
from parallax.engine.tables.lookup_options import BatchDependent
from parallax.engine.tables.replicated import ReplicatedTable
from parallax.errors import SparseIdError, UnsupportedProgramError

MODES = [("allgatherv", False), ("allgatherv", True), ("allreduce", False)]
MODE_IDS = ["allgatherv-dense", "allgatherv-sparse", "allreduce"]


def _param(num_rows: int = 10, seed: int = 0) -> nn.Parameter:
    return nn.Parameter(torch.randn(num_rows, 3, dtype=torch.float64,
                                    generator=torch.Generator().manual_seed(seed)))


def _table(group: dist.ProcessGroup, worker: WorkerInfo, param: nn.Parameter, *, sync: str,
           sparse_grad: bool = False,
           batch_dependent: BatchDependent | None = None) -> ReplicatedTable:
    return ReplicatedTable("emb", param, worker=worker, group=group,
                           traffic=Traffic(worker.rank, worker.machine_of_rank),
                           sparse_grad=sparse_grad, average=True, sync=sync,
                           batch_dependent=batch_dependent)


def _lookups(seed: int = 1) -> list[tuple[Tensor, Tensor]]:
    """Two lookups of one step, repeated ids inside each and across them."""
    generator = torch.Generator().manual_seed(seed)
    first = torch.tensor([[3, 7, 3], [0, 9, 7]])
    second = torch.randint(10, (5,), generator=generator)
    return [(ids, torch.randn(*ids.shape, 3, dtype=torch.float64, generator=generator))
            for ids in (first, second)]


def _dense(grad: Tensor) -> Tensor:
    return grad.to_dense() if grad.is_sparse else grad


@pytest.mark.parametrize(("sync", "sparse_grad"), MODES, ids=MODE_IDS)
def test_pushed_gradient_is_the_single_device_gradient(group, worker, sync: str,
                                                       sparse_grad: bool) -> None:
    """After push, param.grad is F.embedding's gradient (sparse and coalesced if sparse_grad)."""
    param = _param()
    table = _table(group, worker, param, sync=sync, sparse_grad=sparse_grad)
    table.zero_grad()
    lookups = _lookups()
    table.lookup(torch.tensor([1, 2]))  # looked up, never used
    values = lookup_step(table, lookups)
    for value, (ids, _) in zip(values, lookups, strict=True):
        assert torch.equal(value, param.detach()[ids])
    assert param.grad.is_sparse == sparse_grad
    if sparse_grad:
        assert param.grad.is_coalesced()
    torch.testing.assert_close(_dense(param.grad), reference_grad(param, lookups))
    assert table.rows_used == [torch.unique(torch.cat(
        [torch.tensor([1, 2])] + [i.flatten() for i, _ in lookups])).numel()]


@pytest.mark.parametrize(("sync", "sparse_grad"), MODES, ids=MODE_IDS)
def test_zero_grad_starts_the_next_step_from_nothing(group, worker, sync: str,
                                                     sparse_grad: bool) -> None:
    """After zero_grad, a push holds only that step's gradient (not a past or abandoned one)."""
    param = _param()
    table = _table(group, worker, param, sync=sync, sparse_grad=sparse_grad)
    table.zero_grad()
    lookup_step(table, _lookups(seed=1))
    table.zero_grad()
    assert param.grad is None
    rows, _ = table.lookup(torch.tensor([0, 5]))  # an abandoned step: backward, no push
    rows.sum().backward()
    table.zero_grad()
    second = _lookups(seed=2)
    lookup_step(table, second)
    torch.testing.assert_close(_dense(param.grad), reference_grad(param, second))


def test_lookups_without_grad_push_nothing(group, worker) -> None:
    """Lookups under no_grad (evaluation) leave nothing to push: param.grad stays None."""
    param = _param()
    table = _table(group, worker, param, sync="allgatherv")
    table.zero_grad()
    with torch.no_grad():
        ids = torch.tensor([4, 4, 1])
        rows, inverse = table.lookup(ids)
    assert not rows.requires_grad and torch.equal(rows[inverse], param.detach()[ids])
    table.push_gradients()
    assert param.grad is None and table.rows_used == []


@pytest.mark.parametrize("sync", ["allgatherv", "allreduce"])
def test_scale_grad_by_freq_divides_each_row_by_its_count(group, worker, sync: str) -> None:
    """scale_grad_by_freq divides rows by their batch count as F.embedding; one lookup per step."""
    param = _param()
    table = _table(group, worker, param, sync=sync,
                   batch_dependent=BatchDependent(scale_grad_by_freq=True))
    table.zero_grad()
    ids = torch.tensor([[2, 2, 2], [5, 2, 9]])
    coefficient = torch.randn(2, 3, 3, dtype=torch.float64)
    lookup_step(table, [(ids, coefficient)])
    torch.testing.assert_close(
        param.grad, reference_grad(param, [(ids, coefficient)], scale_grad_by_freq=True))
    table.zero_grad()
    table.lookup(torch.tensor([1]))
    with pytest.raises(UnsupportedProgramError,
                       match="'emb' has scale_grad_by_freq=True and was looked up a second time"):
        table.lookup(torch.tensor([1]))


@pytest.mark.parametrize("sync", ["allgatherv", "allreduce"])
def test_max_norm_renormalises_the_replica_like_f_embedding(group, worker, sync: str) -> None:
    """max_norm renormalises replica rows in place as F.embedding does: values, param, grad."""
    param = nn.Parameter(3 * _param().detach())
    table = _table(group, worker, param, sync=sync,
                   batch_dependent=BatchDependent(max_norm=1.0, norm_type=1.0))
    table.zero_grad()
    ids = torch.tensor([[1, 4, 4], [8, 1, 0]])
    coefficient = torch.randn(2, 3, 3, dtype=torch.float64)
    reference = param.detach().clone().requires_grad_(True)
    (value,) = lookup_step(table, [(ids, coefficient)])
    (F.embedding(ids, reference, max_norm=1.0, norm_type=1.0) * coefficient).sum().backward()
    assert not torch.equal(reference.detach(), 3 * _param().detach())  # rows were renormalised
    torch.testing.assert_close(param.detach(), reference.detach())
    torch.testing.assert_close(value, reference.detach()[ids])
    torch.testing.assert_close(param.grad, reference.grad)


@pytest.mark.parametrize("sync", ["allgatherv", "allreduce"])
def test_out_of_range_id_raises_sparse_id_error(group, worker, sync: str) -> None:
    """lookup of an id outside [0, num_rows) raises SparseIdError naming it; nothing is pushed."""
    param = _param()
    table = _table(group, worker, param, sync=sync)
    table.zero_grad()
    with pytest.raises(SparseIdError, match=r"'emb' got id 10 on rank 0 \(machine 0\), "
                                            r"outside its rows \[0, 10\)"):
        table.lookup(torch.tensor([3, 10]))
    with pytest.raises(SparseIdError, match=r"'emb' got id -2 on rank 0"):
        table.lookup(torch.tensor([-2]))
    good = _lookups()
    lookup_step(table, good)
    torch.testing.assert_close(param.grad, reference_grad(param, good))


def test_gradient_norm_and_scaling_are_left_to_the_dense_path(group, worker) -> None:
    """grad_norm_squared is 0, scale_grad a no-op (the dense path's job); full_weight copies."""
    param = _param()
    table = _table(group, worker, param, sync="allgatherv")
    table.zero_grad()
    lookups = _lookups()
    lookup_step(table, lookups)
    assert table.grad_norm_squared().item() == 0.0
    assert table.grad_norm_squared().dtype == torch.float64
    table.scale_grad(torch.tensor(0.5))
    torch.testing.assert_close(param.grad, reference_grad(param, lookups))
    assert table.shard is None
    full = table.full_weight()
    assert torch.equal(full, param.detach()) and full.data_ptr() != param.data_ptr()
    ids = torch.tensor([[9, 0], [9, 9]])
    assert torch.equal(table.read_rows(ids), param.detach()[ids])


def test_scale_grad_by_freq_with_sparse_gradients_is_refused(group, worker) -> None:
    """scale_grad_by_freq with sparse gradients is refused at construction, naming the parameter."""
    with pytest.raises(UnsupportedProgramError, match="parameter 'emb': scale_grad_by_freq"):
        _table(group, worker, _param(), sync="allgatherv", sparse_grad=True,
               batch_dependent=BatchDependent(scale_grad_by_freq=True))
