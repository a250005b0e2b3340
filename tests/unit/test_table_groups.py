"""Table groups (`parallax.engine.tables.table_group`): which server-held tables of one pull
travel as one unit of the exchange, and, in a world of one (rank 0 the only server), that a
group's members read and receive exactly what they would alone: each member's values, its
aggregated gradient, its touched rows, a ``.grad`` of None where no backward reached it, and
a bad id named as the member's own."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from table_steps import reference_grad
from torch import Tensor

from parallax.cluster import WorkerInfo
from parallax.engine.tables import row_exchange
from parallax.engine.tables.exchange import Traffic
from parallax.engine.tables.lookup_options import BatchDependent
from parallax.engine.tables.partitioning import RowPartitioning
from parallax.engine.tables.server_table import ShardedTable
from parallax.engine.tables.sharding import POOLED
from parallax.engine.tables.step_context import TableSteps
from parallax.engine.tables.table_group import TableGroup, group_key, groups_of
from parallax.errors import SparseIdError


def _tables(group: dist.ProcessGroup, worker: WorkerInfo, rows: list[int], *,
            width: int = 3, partitions: int = 1, prefix: str = "t",
            **options: object) -> list[ShardedTable]:
    steps, traffic = TableSteps(), Traffic(worker.rank, worker.machine_of_rank)
    return [ShardedTable(f"{prefix}{k}", _weight(n, k, width), num_partitions=partitions,
                         worker=worker, group=group, traffic=traffic, sparse_grad=False,
                         average=True, steps=steps, **options)  # type: ignore[arg-type]
            for k, n in enumerate(rows)]


def _weight(rows: int, seed: int, width: int = 3) -> Tensor:
    return torch.randn(rows, width, dtype=torch.float64,
                       generator=torch.Generator().manual_seed(seed))


def _lookups(rows: int, seed: int) -> list[tuple[Tensor, Tensor]]:
    generator = torch.Generator().manual_seed(100 + seed)
    ids = torch.randint(rows, (3, 4), generator=generator)
    ids[0, :2] = ids[1, 3]  # repeats for sure
    return [(ids, torch.randn(3, 4, 3, dtype=torch.float64, generator=generator))]


def test_alike_tables_form_one_group_and_the_others_travel_alone(group, worker) -> None:
    """Same dtype, row shape, partitioning, dense gradients and no batch-dependent option:
    one group (cached while they stay alike); anything else travels alone."""
    tables = _tables(group, worker, [10, 7, 12])
    wide = _tables(group, worker, [5], width=4, prefix="wide")[0]
    pooled = _tables(group, worker, [6], prefix="pooled")[0]
    pooled.sharding = POOLED
    renormed = _tables(group, worker, [6], prefix="renormed",
                       batch_dependent=BatchDependent(max_norm=1.0))[0]
    for other in (wide, pooled, renormed):
        other.steps = tables[0].steps
    cache: dict = {}
    units = groups_of([tables[0], wide, tables[1], pooled, renormed, tables[2]], cache)
    assert [type(u).__name__ for u in units] == [
        "TableGroup", "ShardedTable", "ShardedTable", "ShardedTable"]
    grouped = units[0]
    assert isinstance(grouped, TableGroup) and grouped.member_names == ["t0", "t1", "t2"]
    assert (grouped.offsets, grouped.num_rows) == ([0, 10, 17], 29)
    assert {group_key(t) for t in (wide, pooled, renormed)} != {group_key(tables[0])}
    assert group_key(pooled) is None and group_key(renormed) is None
    again = groups_of([tables[0], wide, tables[1], pooled, renormed, tables[2]], cache)
    assert again[0] is grouped  # the same group while nothing changed
    tables[1].partitioning = RowPartitioning(7, 1, worker.server_ranks)  # (a move's new one)
    assert groups_of(tables, cache)[0] is not grouped


def test_a_table_is_in_one_cached_group_at_a_time(group, worker) -> None:
    """A set of tables sharing a table with a cached one drops it (a table's rows are in one
    store at a time); disjoint sets stay; the cache holds the objects, not their ids."""
    tables = _tables(group, worker, [10, 7, 12, 5])
    cache: dict = {}
    first = groups_of(tables[:2], cache)
    other = groups_of(tables[2:], cache)
    assert len(cache) == 2 and groups_of(tables[:2], cache)[0] is first[0]
    groups_of([tables[1], tables[2]], cache)  # shares a table with both
    assert len(cache) == 1 and groups_of(tables[2:], cache)[0] is not other[0]
    assert all(isinstance(entry[0], ShardedTable) for key in cache for entry in key)


def test_more_partitions_than_servers_travel_alone(group, worker) -> None:
    """A server holding two partitions of a table would need each partition's rows apart."""
    assert group_key(_tables(group, worker, [10], partitions=2)[0]) is None
    assert group_key(_tables(group, worker, [10], partitions=1)[0]) is not None


def test_offsets_are_multiples_of_the_partition_count(group, worker) -> None:
    """A group id keeps the partition (so the owner) of its member's id."""
    shared = RowPartitioning(1, 1, worker.server_ranks)
    tables = _tables(group, worker, [10, 7, 12])
    for table in tables:  # three partitions, as on three servers (offsets only: no pull)
        table.partitioning = RowPartitioning(table.num_rows, 3, (0, 1, 2))
    grouped = TableGroup(tables)
    assert grouped.offsets == [0, 12, 21] and grouped.num_rows == 33
    for member, offset in zip(tables, grouped.offsets, strict=True):
        ids = torch.arange(member.num_rows)
        assert torch.equal(grouped.partitioning.owner_rank(ids + offset),
                           member.partitioning.owner_rank(ids))
    del shared


def test_a_group_pull_and_push_give_each_member_its_single_device_values_and_gradient(
        group, worker) -> None:
    """Prefetch, lookups, backward and push of a group of three: each member's looked-up
    values and aggregated gradient are the single-device ones, its shard and gradient view
    the group's store, and its touched rows are those its ids address."""
    rows = [10, 7, 12]
    tables = _tables(group, worker, rows)
    weights = [_weight(n, k) for k, n in enumerate(rows)]
    lookups = [_lookups(n, k) for k, n in enumerate(rows)]
    for step in range(2):  # the second step reuses the group and its store
        for table in tables:
            table.zero_grad()
        row_exchange.prefetch(tables, [[ids for ids, _ in looked] for looked in lookups])
        loss = torch.zeros((), dtype=torch.float64)
        for table, weight, looked in zip(tables, weights, lookups, strict=True):
            for ids, coefficient in looked:
                pulled, inverse = table.lookup(ids)
                assert torch.equal(pulled[inverse], weight[ids]), (step, table.name)
                loss = loss + (pulled[inverse] * coefficient).sum()
        loss.backward()
        row_exchange.push_gradients(tables)
        (grouped,) = tables[0].steps.groups[next(iter(tables[0].steps.groups))]
        assert isinstance(grouped, TableGroup)
        store = grouped.shard
        assert store is not None and store.shape[0] == sum(rows)
        for table, weight, looked in zip(tables, weights, lookups, strict=True):
            shard = table.server_shard()
            assert shard.untyped_storage().data_ptr() == store.untyped_storage().data_ptr()
            assert torch.equal(shard.detach(), weight)
            assert shard.grad is not None
            torch.testing.assert_close(shard.grad, reference_grad(weight, looked))
            used = torch.unique(torch.cat([ids.reshape(-1) for ids, _ in looked]))
            assert torch.equal(table.touched_rows(), used)


def test_a_member_no_backward_reached_has_no_gradient(group, worker) -> None:
    """A member looked up but not in the loss: its leaf rows get no .grad (so the servers'
    optimizer skips it, as torch skips a .grad of None), its gradient stays zero."""
    tables = _tables(group, worker, [10, 7])
    for table in tables:
        table.zero_grad()
    ids = torch.tensor([[1, 2], [3, 1]])
    row_exchange.prefetch(tables, [[ids], [ids]])
    reached, _ = tables[0].lookup(ids)
    tables[1].lookup(ids)
    reached.sum().backward()
    row_exchange.push_gradients(tables)
    assert tables[0].has_gradient and not tables[1].has_gradient
    assert tables[1].server_shard().grad is not None
    assert not tables[1].server_shard().grad.any()


def test_a_bad_id_of_a_member_is_named_as_its_own(group, worker) -> None:
    """An id outside a member's rows is refused naming the member and its rows, never read
    as the next member's row."""
    tables = _tables(group, worker, [10, 7])
    with pytest.raises(SparseIdError, match=r"'t0' got id 10 .* outside its rows \[0, 10\)"):
        row_exchange.prefetch(tables, [[torch.tensor([1, 10])], [torch.tensor([0])]])
    with pytest.raises(SparseIdError, match=r"'t1' got id -1 .* outside its rows \[0, 7\)"):
        row_exchange.prefetch(tables, [[torch.tensor([1])], [torch.tensor([-1, 2])]])


def test_a_member_whose_shard_moved_is_taken_into_a_new_store(group, worker) -> None:
    """A shard swapped under the group (a checkpoint, a move) is read again, values kept."""
    tables = _tables(group, worker, [10, 7])
    ids = torch.tensor([0, 6])
    for table in tables:
        table.zero_grad()
    row_exchange.prefetch(tables, [[ids], [ids]])
    with torch.no_grad():
        tables[1].set_shard(torch.nn.Parameter(torch.full((7, 3), 2.0, dtype=torch.float64)))
    for table in tables:
        table.zero_grad()
    row_exchange.prefetch(tables, [[ids], [ids]])
    pulled, inverse = tables[1].lookup(ids)
    assert torch.equal(pulled[inverse], torch.full((2, 3), 2.0, dtype=torch.float64))
    first, inverse = tables[0].lookup(ids)
    assert torch.equal(first[inverse], _weight(10, 0)[ids])


@pytest.mark.parametrize("make", [
    lambda params: torch.optim.Adagrad(params, lr=0.1, lr_decay=0.01, eps=1e-6),
    lambda params: torch.optim.SGD(params, lr=0.1)], ids=["adagrad", "sgd"])
def test_the_servers_update_a_group_as_one_step_exactly(group, worker, monkeypatch, make,
                                                        ) -> None:
    """Members of one param group take one row update over the group's store (Adagrad's
    ``sum`` a store too, its step count advanced once and copied), equal to the bit to the
    user's optimizer on one device; a step one member skips (no .grad on one device) and,
    under Adagrad, the steps after it, whose counts then differ, take each member's own
    update, as exactly."""
    from parallax.engine.optimizers import shard_optimizer
    from parallax.engine.optimizers.shard_optimizer import ShardOptimizer
    rows = [10, 7, 12]
    weights = [torch.nn.Parameter(_weight(n, k)) for k, n in enumerate(rows)]
    user = make(weights)
    tables = _tables(group, worker, rows)
    servers = ShardOptimizer([user], {id(w): t for w, t in zip(weights, tables, strict=True)})
    sizes: list[list[int]] = []
    real = shard_optimizer.update_rows
    monkeypatch.setattr(shard_optimizer, "update_rows", lambda cls, hyper, steps: (
        sizes.append([step.param.shape[0] for step in steps]), real(cls, hyper, steps))[1])
    generator = torch.Generator().manual_seed(5)
    for step in range(5):
        skipped = 1 if step == 2 else None
        looked = [torch.randint(n, (3, 2), generator=generator) for n in rows]
        coefficients = [torch.randn(3, 2, 3, dtype=torch.float64, generator=generator)
                        for _ in rows]
        for table in tables:
            table.zero_grad()
            table.gradient_anywhere = table is not tables[skipped or 0] or skipped is None
        row_exchange.prefetch(tables, [[ids] for ids in looked])
        loss = sum((table.lookup(ids)[0][table.lookup(ids)[1]] * c).sum()
                   for table, ids, c in zip(tables, looked, coefficients, strict=True))
        loss.backward()  # type: ignore[union-attr]
        row_exchange.push_gradients(tables)
        sizes.clear()
        servers.step()
        user.zero_grad()
        sum((F.embedding(ids, w) * c).sum()
            for w, ids, c in zip(weights, looked, coefficients, strict=True)).backward()
        if skipped is not None:
            weights[skipped].grad = None
        user.step()
        # (plain SGD keeps no count: its members fuse again after the skip)
        fused = step < 2 or step > 2 and isinstance(user, torch.optim.SGD)
        assert sizes == ([[sum(rows)]] if fused else [[10, 12]] if step == 2
                         else [[10, 7, 12]]), step
        for table, weight in zip(tables, weights, strict=True):
            assert torch.equal(table.full_weight(), weight.detach()), (step, table.name)
