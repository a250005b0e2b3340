"""The step of a run's server-held tables (`parallax.engine.tables.step_context`): what a step
pulled and owes lives in the run's `TableSteps`, never on a table; a context ends when its
push has sent every row owed, and nothing of it outlives that. In a world of one (rank 0 is
the only server), against the single-device gradient of the same lookups."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from table_steps import reference_grad
from torch import Tensor

from parallax.cluster import WorkerInfo
from parallax.engine.tables import row_exchange
from parallax.engine.tables.exchange import Traffic
from parallax.engine.tables.replicated import ReplicatedTable
from parallax.engine.tables.server_table import ShardedTable
from parallax.engine.tables.step_context import TableSteps
from parallax.errors import InternalError

STEP_ATTRIBUTES = ("_pending", "prefetched", "pooled_calls", "pooled_ahead", "_lookups",
                   "_pushed_after_backward")


def _tables(group: dist.ProcessGroup, worker: WorkerInfo, steps: TableSteps | None,
            partitions: tuple[int, ...] = (1, 3)) -> list[ShardedTable]:
    return [ShardedTable(name, _weight(seed), num_partitions=count, worker=worker, group=group,
                         traffic=Traffic(worker.rank, worker.machine_of_rank),
                         sparse_grad=False, average=True, steps=steps)
            for seed, (name, count) in enumerate(zip("ab", partitions, strict=False))]


def _weight(seed: int) -> Tensor:
    return torch.randn(8, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _ids(seed: int) -> Tensor:
    return torch.randint(8, (3, 2), generator=torch.Generator().manual_seed(10 + seed))


def _dense_grad(table: ShardedTable) -> Tensor:
    """The aggregated gradient in global row order."""
    grad = torch.zeros_like(table.shard)
    grad[table.partitioning.rows_of_server(0)] = table.shard.grad
    return grad


def test_a_step_lives_in_the_runs_context_and_ends_with_its_push(group, worker) -> None:
    """The pull is owed in the run's context (one record for both tables), the prefetched rows
    are the forward's; no table keeps any of it; the push ends the context, and the next step
    starts from a fresh one. The gradients are the single-device ones."""
    steps = TableSteps()
    tables = _tables(group, worker, steps)
    for table in tables:
        table.zero_grad()
        assert not any(hasattr(table, name) for name in STEP_ATTRIBUTES)
    ids = [_ids(0), _ids(1)]
    row_exchange.prefetch(tables, [[i] for i in ids])
    step = steps.current
    assert len(step.pulls) == 1 and set(step.pulls[0].lookups) == {"a", "b"}
    assert set(step.prefetched) == {"a", "b"}
    coefficients = [torch.randn(*i.shape, 2, dtype=torch.float64) for i in ids]
    loss = torch.zeros((), dtype=torch.float64)
    for table, table_ids, coefficient in zip(tables, ids, coefficients, strict=True):
        rows, inverse = table.lookup(table_ids)
        loss = loss + (rows[inverse] * coefficient).sum()
    for table in tables:
        table.forget_prefetched()  # the forward ends
    assert not step.prefetched and len(step.pulls) == 1  # still owed
    loss.backward()
    row_exchange.push_gradients(tables)
    assert steps.current is not step and not steps.current.pulls
    for table, table_ids, coefficient in zip(tables, ids, coefficients, strict=True):
        torch.testing.assert_close(_dense_grad(table), reference_grad(
            _weight(tables.index(table)), [(table_ids, coefficient)]))


def test_zero_grad_between_a_forward_and_its_backward_keeps_the_pull_owed(group,
                                                                          worker) -> None:
    """A forward, then zero_grad, then the backward is a valid program: the pull stays owed
    (its rows' gradients cleared) and the push still sends the backward's rows."""
    steps = TableSteps()
    (table,) = _tables(group, worker, steps, partitions=(2,))
    ids, coefficient = _ids(0), torch.randn(3, 2, 2, dtype=torch.float64)
    rows, inverse = table.lookup(ids)
    loss = (rows[inverse] * coefficient).sum()
    table.zero_grad()
    assert len(steps.current.pulls) == 1
    loss.backward()
    table.push_gradients()
    assert not steps.current.pulls
    torch.testing.assert_close(_dense_grad(table), reference_grad(_weight(0), [(ids, coefficient)]))


def test_a_push_of_some_tables_leaves_the_others_pulls_owed(group, worker) -> None:
    """Tables pulled apart and pushed apart: each push takes its own pulls only, and the
    context ends once the last is sent."""
    steps = TableSteps()
    first, second = _tables(group, worker, steps)
    rows_a, inverse_a = first.lookup(_ids(0))
    rows_b, inverse_b = second.lookup(_ids(1))
    (rows_a[inverse_a].sum() + rows_b[inverse_b].sum()).backward()
    step = steps.current
    first.push_gradients()
    assert steps.current is step and [set(p.lookups) for p in step.pulls] == [{"b"}]
    second.push_gradients()
    assert steps.current is not step and not steps.current.pulls


def test_a_lookup_outside_grad_owes_nothing(group, worker) -> None:
    """Under no_grad (an evaluation) a pull owes no gradient: nothing stays in the context."""
    steps = TableSteps()
    (table,) = _tables(group, worker, steps, partitions=(1,))
    with torch.no_grad():
        rows, inverse = table.lookup(_ids(0))
    assert torch.equal(rows[inverse], _weight(0)[_ids(0)])
    assert not steps.current.pulls


def test_tables_of_two_runs_cannot_share_one_exchange(group, worker) -> None:
    """Every table of one exchange belongs to one run's step: anything else is refused as our
    bug, before a collective."""
    tables = _tables(group, worker, None)  # (each made alone: a run of its own)
    assert tables[0].steps is not tables[1].steps
    with pytest.raises(InternalError, match="different runs"):
        row_exchange.pull(tables, [_ids(0), _ids(1)])


@pytest.mark.parametrize("sync", ["allgatherv", "allreduce"])
def test_a_replicated_tables_lookups_are_owed_in_the_runs_context(group, worker,
                                                                  sync: str) -> None:
    """A replica's lookups are owed in the run's context, not on the table; the own loop's
    sum at a backward's end keeps them owed (a retained graph's next backward adds to them)
    and the step's push then sends nothing more; the gradient is the single-device one."""
    steps = TableSteps()
    param = torch.nn.Parameter(_weight(0))
    table = ReplicatedTable("r", param, worker=worker, group=group,
                            traffic=Traffic(worker.rank, worker.machine_of_rank),
                            sparse_grad=False, average=True, sync=sync, steps=steps)
    table.zero_grad()
    assert not any(hasattr(table, name) for name in STEP_ATTRIBUTES)
    ids, coefficient = _ids(0), torch.randn(3, 2, 2, dtype=torch.float64)
    rows, inverse = table.lookup(ids)
    assert [lookup.rows for lookup in steps.owed("r")] == [rows]
    (rows[inverse] * coefficient).sum().backward(retain_graph=True)
    table.push_after_backward()
    assert steps.owed("r") and steps.current.summed_after_backward == {"r"}
    once = param.grad.clone()
    (rows[inverse] * coefficient).sum().backward()  # the retained graph, again
    table.push_after_backward()
    table.push_gradients()  # the step's push: both backwards' rows went already
    assert not steps.current.owed and not steps.current.summed_after_backward
    reference = reference_grad(_weight(0), [(ids, coefficient)])
    torch.testing.assert_close(once, reference)
    torch.testing.assert_close(param.grad, 2 * reference)


def test_a_push_of_tables_of_different_runs_is_refused(group, worker) -> None:
    """Tables whose pulls live in different runs' step contexts cannot be pushed together:
    the push would miss the other run's rows; it is refused as our bug, not left silent."""
    tables = [ShardedTable(f"t{i}", torch.zeros(4, 2, dtype=torch.float64), num_partitions=1,
                           worker=worker, group=group, traffic=Traffic(0, (0,)),
                           sparse_grad=False, average=True) for i in range(2)]
    for table in tables:
        rows, inverse = table.lookup(torch.tensor([1, 2]))
        rows[inverse].sum().backward()
    with pytest.raises(InternalError, match="different runs"):
        ShardedTable.push_together(tables)
