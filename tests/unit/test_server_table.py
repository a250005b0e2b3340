"""Server-held parameters (`parallax.engine.tables.server_table`): where rows live
(`RowPartitioning`), and a `ShardedTable`'s pull, push and gradient in a world of one, where
rank 0 is the only server and its shard holds every row: whatever the partitioning, the
aggregated gradient must be the single-device gradient of the same lookups, row for row."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from table_steps import lookup_step, reference_grad
from torch import Tensor

from parallax.cluster import WorkerInfo
from parallax.engine.tables.exchange import Traffic
from parallax.engine.tables.lookup_options import BatchDependent
from parallax.engine.tables.row_exchange import prefetch
from parallax.engine.tables.server_table import RowPartitioning, ShardedTable
from parallax.engine.tables.step_context import TableSteps
from parallax.errors import SparseIdError, UnsupportedProgramError

# ---- RowPartitioning (no group) ---------------------------------------------------------------


def test_partitions_by_id_mod_p_placed_round_robin_from_first_server() -> None:
    """RowPartitioning: partition id % P on server (p + first) % S, partitions stacked per shard."""
    part = RowPartitioning(num_rows=10, num_partitions=3, server_ranks=(0, 2), first_server=0)
    # p0 = {0,3,6,9} and p2 = {2,5,8} on server 0 (rank 0); p1 = {1,4,7} on server 1 (rank 2)
    assert part.shard_rows == [7, 3]
    assert part.rows_of_server(0).tolist() == [0, 3, 6, 9, 2, 5, 8]
    assert part.rows_of_server(1).tolist() == [1, 4, 7]
    assert part.shard_blocks(0) == [(0, 4), (4, 7)] and part.shard_blocks(1) == [(0, 3)]
    ids = torch.tensor([0, 5, 7, 9])
    assert part.owner_rank(ids).tolist() == [0, 0, 2, 0]
    assert part.local_row(ids).tolist() == [0, 5, 2, 3]
    shifted = RowPartitioning(num_rows=10, num_partitions=3, server_ranks=(0, 2), first_server=1)
    assert shifted.owner_rank(ids).tolist() == [2, 2, 0, 2]
    assert shifted.shard_rows == [3, 7]


@pytest.mark.parametrize(("num_rows", "partitions", "servers", "first"), [
    (1, 1, (0,), 0), (10, 1, (0, 3), 1), (11, 4, (0, 2, 5), 2), (3, 5, (0, 1), 0),
    (64, 8, (0, 4), 1)])
def test_every_row_lives_in_exactly_one_place(num_rows: int, partitions: int,
                                              servers: tuple[int, ...], first: int) -> None:
    """RowPartitioning: every id has one owner and one shard row, and the blocks tile each shard."""
    part = RowPartitioning(num_rows, partitions, servers, first)
    ids = torch.arange(num_rows)
    held = [part.rows_of_server(s) for s in range(len(servers))]
    assert sorted(torch.cat(held).tolist()) == list(range(num_rows))
    assert [h.numel() for h in held] == part.shard_rows
    owners, local = part.owner_rank(ids), part.local_row(ids)
    for i in range(num_rows):
        server = servers.index(int(owners[i]))
        assert int(held[server][local[i]]) == i
    for s in range(len(servers)):
        edges = [0] + [stop for _, stop in part.shard_blocks(s)]
        assert [start for start, _ in part.shard_blocks(s)] == edges[:-1]
        assert edges[-1] == part.shard_rows[s]


# ---- ShardedTable in a world of one -----------------------------------------------------------


def _table(group: dist.ProcessGroup, worker: WorkerInfo, weight: Tensor, *,
           partitions: int = 1, sparse_grad: bool = False,
           batch_dependent: BatchDependent | None = None) -> ShardedTable:
    return ShardedTable("emb", weight, num_partitions=partitions, worker=worker, group=group,
                        traffic=Traffic(worker.rank, worker.machine_of_rank),
                        sparse_grad=sparse_grad, average=True, batch_dependent=batch_dependent)


def _shard_order(table: ShardedTable) -> Tensor:
    """Global ids of the shard's rows, in shard order."""
    return table.partitioning.rows_of_server(0)


def _dense_shard_grad(table: ShardedTable) -> Tensor:
    """The shard's aggregated gradient, dense, in shard order (sparse: its partitions')."""
    if not table.sparse_grad:
        return table.shard.grad
    grad = torch.zeros_like(table.shard)
    for part, (start, stop) in zip(table.parts, table.blocks, strict=True):
        if part.grad is not None:
            grad[start:stop] = part.grad.to_dense()
    return grad


def _weight(num_rows: int = 10, seed: int = 0) -> Tensor:
    return torch.randn(num_rows, 3, dtype=torch.float64,
                       generator=torch.Generator().manual_seed(seed))


def _lookups(num_rows: int, seed: int = 1) -> list[tuple[Tensor, Tensor]]:
    """Two lookups of one step, with repeated ids inside each and across them."""
    generator = torch.Generator().manual_seed(seed)
    first = torch.randint(num_rows, (4, 3), generator=generator)
    first[0, :2] = first[1, 2]  # repeats for sure
    second = torch.cat([first[0, :1], torch.randint(num_rows, (4,), generator=generator)])
    return [(ids, torch.randn(*ids.shape, 3, dtype=torch.float64, generator=generator))
            for ids in (first, second)]


@pytest.mark.parametrize("sparse_grad", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize(("num_rows", "partitions"), [(10, 1), (10, 3), (3, 5)])
def test_pushed_gradient_is_the_single_device_gradient(group, worker, sparse_grad: bool,
                                                       num_rows: int, partitions: int) -> None:
    """push_gradients sums repeats and lookups into F.embedding's gradient, in shard order."""
    weight = _weight(num_rows)
    table = _table(group, worker, weight, partitions=partitions, sparse_grad=sparse_grad)
    assert len(table.parts) == partitions
    table.zero_grad()
    lookups = _lookups(num_rows)
    values = lookup_step(table, lookups)
    for value, (ids, _) in zip(values, lookups, strict=True):
        assert torch.equal(value, weight[ids])
    expected = reference_grad(weight, lookups)[_shard_order(table)]
    if sparse_grad:
        assert all(p.grad is None or p.grad.is_sparse for p in table.parts)
    torch.testing.assert_close(_dense_shard_grad(table), expected)
    assert table.rows_used == [torch.unique(torch.cat([i.flatten() for i, _ in lookups])).numel()]


@pytest.mark.parametrize("sparse_grad", [False, True], ids=["dense", "sparse"])
def test_zero_grad_starts_the_next_step_from_nothing(group, worker, sparse_grad: bool) -> None:
    """After zero_grad, a push holds only that step's gradient (not a past or abandoned one)."""
    weight = _weight()
    table = _table(group, worker, weight, partitions=3, sparse_grad=sparse_grad)
    table.zero_grad()
    lookup_step(table, _lookups(10, seed=1))
    table.zero_grad()
    rows, _ = table.lookup(torch.tensor([0, 5]))  # an abandoned step: backward, no push
    rows.sum().backward()
    table.zero_grad()
    second = _lookups(10, seed=2)
    lookup_step(table, second)
    torch.testing.assert_close(_dense_shard_grad(table),
                               reference_grad(weight, second)[_shard_order(table)])


def test_zero_grad_of_touched_rows_only_leaves_a_zero_gradient(group, worker) -> None:
    """Under an optimizer that never writes gradients (`grad_zero_elsewhere`), zero_grad clears
    the rows that received gradient only, yet every step starts from a zero gradient; after
    a non-finite scale (0 x inf is NaN in every row) the whole gradient is cleared."""
    weight = _weight()
    table = _table(group, worker, weight, partitions=3)
    table.grad_zero_elsewhere = True
    table.zero_grad()
    for seed, factor in ((1, 0.5), (2, float("inf")), (3, 1.0), (4, 1.0)):
        table.zero_grad()
        lookups = _lookups(10, seed=seed)
        lookup_step(table, lookups)
        torch.testing.assert_close(_dense_shard_grad(table),
                                   reference_grad(weight, lookups)[_shard_order(table)])
        table.scale_grad(torch.tensor(factor, dtype=torch.float64))
        if factor == float("inf"):
            assert table.shard.grad.isnan().any()  # untouched rows too, as on one device


@pytest.mark.parametrize("sparse_grad", [False, True], ids=["dense", "sparse"])
def test_grad_norm_squared_and_scale_grad(group, worker, sparse_grad: bool) -> None:
    """grad_norm_squared is the gradient's squared L2 norm; scale_grad scales every partition."""
    weight = _weight()
    table = _table(group, worker, weight, partitions=3, sparse_grad=sparse_grad)
    table.zero_grad()
    lookups = _lookups(10)
    lookup_step(table, lookups)
    expected = reference_grad(weight, lookups)
    squared = table.grad_norm_squared()
    assert squared.dtype == torch.float64 and squared.shape == ()
    torch.testing.assert_close(squared, expected.pow(2).sum())
    table.scale_grad(torch.tensor(0.25))
    torch.testing.assert_close(_dense_shard_grad(table), 0.25 * expected[_shard_order(table)])
    torch.testing.assert_close(table.grad_norm_squared(), expected.pow(2).sum() / 16)


def test_grad_norm_squared_is_zero_before_any_push(group, worker) -> None:
    """grad_norm_squared: zero when nothing was pushed (sparse: no partition has a gradient)."""
    table = _table(group, worker, _weight(), partitions=2, sparse_grad=True)
    table.zero_grad()
    assert table.grad_norm_squared().item() == 0.0


def test_full_weight_and_read_rows_gather_in_global_order(group, worker) -> None:
    """full_weight/read_rows return rows in global order, following updates of the shard."""
    weight = _weight(11)
    table = _table(group, worker, weight, partitions=4)
    assert not torch.equal(_shard_order(table), torch.arange(11))  # the shard is permuted
    assert torch.equal(table.full_weight(), weight)
    with torch.no_grad():
        table.shard += torch.arange(11, dtype=torch.float64).unsqueeze(1)
    expected = weight.clone()
    expected[_shard_order(table)] += torch.arange(11, dtype=torch.float64).unsqueeze(1)
    assert torch.equal(table.full_weight(), expected)
    ids = torch.tensor([[10, 0], [10, 3]])
    assert torch.equal(table.read_rows(ids), expected[ids])
    source = torch.arange(33, dtype=torch.float64).view(11, 3)  # shard-shaped, e.g. a state
    assert torch.equal(table.full_weight(source)[_shard_order(table)], source)


def test_initial_shard_is_the_weight_in_shard_order(group, worker) -> None:
    """The server's shard starts as a copy of the weight's rows in shard order, not a view."""
    weight = _weight()
    table = _table(group, worker, weight, partitions=3)
    assert torch.equal(table.shard.detach(), weight[_shard_order(table)])
    with torch.no_grad():
        table.shard.zero_()
    assert weight.abs().sum() > 0


@pytest.mark.parametrize(("bad", "ids"), [(10, [3, 10]), (-1, [-1, 2]), (12, [12, 11, 0])])
def test_out_of_range_id_raises_sparse_id_error(group, worker, bad: int, ids: list[int]) -> None:
    """lookup of an id outside [0, num_rows) raises SparseIdError; the table stays usable."""
    weight = _weight()
    table = _table(group, worker, weight, partitions=2)
    table.zero_grad()
    with pytest.raises(SparseIdError, match=rf"'emb' got id {bad} on rank 0 \(machine 0\), "
                                            r"outside its rows \[0, 10\)"):
        table.lookup(torch.tensor(ids))
    good = _lookups(10)
    lookup_step(table, good)
    torch.testing.assert_close(_dense_shard_grad(table),
                               reference_grad(weight, good)[_shard_order(table)])


def test_float_ids_are_refused(group, worker) -> None:
    """lookup of float ids raises TypeError naming the parameter."""
    table = _table(group, worker, _weight())
    with pytest.raises(TypeError, match="parameter 'emb' on rank 0: ids must be an integer"):
        table.lookup(torch.tensor([1.0]))


def test_prefetched_rows_serve_every_lookup_of_the_step(group, worker) -> None:
    """Prefetched rows serve the step's lookups exactly; zero_grad drops them; misses raise."""
    weight = _weight()
    table = _table(group, worker, weight, partitions=3)
    table.zero_grad()
    lookups = _lookups(10)
    prefetch([table], [[ids for ids, _ in lookups]])
    values = lookup_step(table, lookups)
    for value, (ids, _) in zip(values, lookups, strict=True):
        assert torch.equal(value, weight[ids])
    torch.testing.assert_close(_dense_shard_grad(table),
                               reference_grad(weight, lookups)[_shard_order(table)])
    table.zero_grad()  # forgets the prefetched rows: the next lookup pulls its own
    assert torch.equal(table.lookup(torch.tensor([7, 5]))[0], weight[[5, 7]])  # not prefetched
    table.zero_grad()
    prefetch([table], [[torch.tensor([1, 2])]])
    with pytest.raises(RuntimeError, match="'emb' that were not pulled ahead"):
        table.lookup(torch.tensor([2, 3]))


def test_one_pull_of_tables_with_one_and_several_partitions(group, worker,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            ) -> None:
    """A one-partition table's ids go to their one owner unsorted (no argsort) and its server
    takes the rows they address as its touched rows (no unique); the other tables' counts come
    back in one read; values and gradients are the single-device ones."""
    from parallax.engine.tables import row_exchange
    weights = [_weight(10, seed) for seed in range(3)]
    steps = TableSteps()  # (one run's tables share its step)
    tables = [ShardedTable(name, weight, num_partitions=partitions, worker=worker, group=group,
                           traffic=Traffic(worker.rank, worker.machine_of_rank),
                           sparse_grad=False, average=True, steps=steps)
              for name, weight, partitions in zip(("a", "b", "c"), weights, (1, 3, 2),
                                                  strict=True)]
    sorts, reads = [], []
    argsort, read_back = torch.argsort, row_exchange.read_back
    monkeypatch.setattr(torch, "argsort", lambda *a, **k: sorts.append(1) or argsort(*a, **k))
    monkeypatch.setattr(row_exchange, "read_back",
                        lambda vectors: reads.append(len(vectors)) or read_back(vectors))
    lookups = [_lookups(10, seed) for seed in range(3)]
    for table in tables:
        table.zero_grad()
    prefetch(tables, [[ids for ids, _ in table_lookups] for table_lookups in lookups])
    assert (len(sorts), reads) == (2, [2])  # "b" and "c" sorted, their counts read together
    loss = torch.zeros((), dtype=torch.float64)
    for table, weight, table_lookups in zip(tables, weights, lookups, strict=True):
        for ids, coefficient in table_lookups:
            rows, inverse = table.lookup(ids)
            assert torch.equal(rows[inverse], weight[ids])
            loss = loss + (rows[inverse] * coefficient).sum()
    loss.backward()
    row_exchange.push_gradients(tables)
    for table, weight, table_lookups in zip(tables, weights, lookups, strict=True):
        torch.testing.assert_close(_dense_shard_grad(table),
                                   reference_grad(weight, table_lookups)[_shard_order(table)])
    # the one sender's rows of the one-partition table are its touched rows as they arrived
    uniques, unique = [], torch.unique
    monkeypatch.setattr(torch, "unique", lambda *a, **k: uniques.append(1) or unique(*a, **k))
    for table, table_lookups in zip(tables, lookups, strict=True):
        ids = torch.unique(torch.cat([i.reshape(-1) for i, _ in table_lookups]))
        held = table.partitioning.local_row(ids)
        assert torch.equal(table.touched_rows(), held.sort().values)
    assert len(uniques) == 3 + 2  # the expected ids' three, and "b" and "c" only


def test_a_lookup_of_the_very_ids_read_ahead_is_served_without_a_search(group, worker) -> None:
    """The ids tensor a lookup was read ahead from gets the pull's own leaf rows and inverse;
    an equal copy, or that tensor written in place since, is searched among the pulled ids.
    Values and the pushed gradient are the single-device ones either way."""
    weight = _weight()
    table = _table(group, worker, weight, partitions=3)
    table.zero_grad()
    (first, first_grad), (second, second_grad) = _lookups(10)
    written = second.clone()
    prefetch([table], [[first, written]])
    leaf = _prefetched_rows(table)
    rows, inverse = table.lookup(first)
    assert rows is leaf and torch.equal(rows[inverse], weight[first])
    written.copy_(second)  # the same values, but written since the look-ahead: searched
    searched, searched_inverse = table.lookup(written)
    assert searched is not leaf and torch.equal(searched[searched_inverse], weight[second])
    copy_rows, copy_inverse = table.lookup(first.clone())  # an equal copy: searched
    assert copy_rows is not leaf and torch.equal(copy_rows[copy_inverse], weight[first])
    loss = ((rows[inverse] * first_grad).sum() + (searched[searched_inverse] * second_grad).sum())
    loss.backward()
    table.push_gradients()
    torch.testing.assert_close(
        _dense_shard_grad(table),
        reference_grad(weight, [(first, first_grad), (second, second_grad)])[_shard_order(table)])


def test_a_view_of_the_same_columns_is_served_and_another_column_searched(group,
                                                                         worker) -> None:
    """The forward's own ``x[:, 0]`` beside the look-ahead's (another view object of the same
    memory, laid out alike) is served by the pull; ``x[:, 1]``, or ``x[:, 0]`` after a write
    into ``x``, is searched. Values and gradients are the single-device ones either way."""
    weight = _weight()
    table = _table(group, worker, weight, partitions=3)
    table.zero_grad()
    x = torch.tensor([[1, 5], [5, 9], [2, 1]])
    prefetch([table], [[x[:, 0], x[:, 1]]])
    leaf = _prefetched_rows(table)
    first, first_inverse = table.lookup(x[:, 0])
    assert first is leaf and torch.equal(first[first_inverse], weight[x[:, 0]])
    assert table.lookup(x[:, 0].clone())[0] is not leaf  # other memory: searched
    assert table.lookup(x.t()[1])[0] is leaf  # column 1 again, by another route
    x[2, 1] = 9  # a write into x (the look-ahead pulled 9 already): x's views are searched
    second, second_inverse = table.lookup(x[:, 1])
    assert second is not leaf and torch.equal(second[second_inverse], weight[x[:, 1]])
    coefficients = torch.randn(2, 3, 3, dtype=torch.float64,
                               generator=torch.Generator().manual_seed(3))
    loss = ((first[first_inverse] * coefficients[0]).sum()
            + (second[second_inverse] * coefficients[1]).sum())
    loss.backward()
    table.push_gradients()
    torch.testing.assert_close(_dense_shard_grad(table), reference_grad(
        weight, [(x[:, 0], coefficients[0]), (x[:, 1], coefficients[1])])[_shard_order(table)])


def test_ids_made_in_inference_mode_are_searched_among_the_pulled(group, worker) -> None:
    """An inference tensor keeps no version (an in-place write inside inference mode would go
    unseen): its lookup is searched, as in an evaluation under torch.inference_mode."""
    weight = _weight()
    table = _table(group, worker, weight, partitions=3)
    table.zero_grad()
    with torch.inference_mode():
        ids = torch.tensor([[1, 5], [5, 9]])
        prefetch([table], [[ids]])
        rows, inverse = table.lookup(ids)
    assert rows is not _prefetched_rows(table) and torch.equal(rows[inverse], weight[ids])


def test_prefetch_takes_int32_ids_as_lookup_does(group, worker) -> None:
    """prefetch accepts int32 ids as lookup does (Runner.step pulls int32 input ids ahead)."""
    weight = _weight()
    table = _table(group, worker, weight, partitions=3)
    table.zero_grad()
    ids = torch.tensor([[1, 5], [5, 9]], dtype=torch.int32)
    prefetch([table], [[ids]])
    rows, inverse = table.lookup(ids)
    assert torch.equal(rows[inverse], weight[ids.long()])


def test_max_norm_renormalises_the_served_rows_like_f_embedding(group, worker) -> None:
    """max_norm renormalises the served rows in place as F.embedding does: values, table, grad."""
    weight = 3 * _weight()
    table = _table(group, worker, weight, partitions=2,
                   batch_dependent=BatchDependent(max_norm=1.0))
    table.zero_grad()
    ids = torch.tensor([[1, 4, 4], [8, 1, 0]])
    coefficient = torch.randn(2, 3, 3, dtype=torch.float64)
    (value,) = lookup_step(table, [(ids, coefficient)])
    reference = weight.clone().requires_grad_(True)
    (F.embedding(ids, reference, max_norm=1.0) * coefficient).sum().backward()
    torch.testing.assert_close(value, F.embedding(ids, reference.detach()))
    torch.testing.assert_close(table.full_weight(), reference.detach())
    assert not torch.equal(reference.detach(), weight)  # some rows were renormalised
    torch.testing.assert_close(table.shard.grad, reference.grad[_shard_order(table)])


def test_scale_grad_by_freq_divides_each_row_by_its_count(group, worker) -> None:
    """scale_grad_by_freq divides rows by their batch count as F.embedding; one lookup per step."""
    weight = _weight()
    options = BatchDependent(scale_grad_by_freq=True)
    table = _table(group, worker, weight, partitions=3, batch_dependent=options)
    table.zero_grad()
    ids = torch.tensor([[2, 2, 2], [5, 2, 9]])
    coefficient = torch.randn(2, 3, 3, dtype=torch.float64)
    lookup_step(table, [(ids, coefficient)])
    expected = reference_grad(weight, [(ids, coefficient)], scale_grad_by_freq=True)
    torch.testing.assert_close(table.shard.grad, expected[_shard_order(table)])
    table.zero_grad()
    table.lookup(torch.tensor([1]))
    with pytest.raises(UnsupportedProgramError,
                       match="'emb' has scale_grad_by_freq=True and was looked up a second time"):
        table.lookup(torch.tensor([1]))


def test_refusals_at_construction(group, worker) -> None:
    """A scalar parameter, and scale_grad_by_freq with sparse gradients, are refused."""
    with pytest.raises(ValueError, match="parameter 'emb' must have rows"):
        _table(group, worker, torch.tensor(1.0, dtype=torch.float64))
    with pytest.raises(UnsupportedProgramError, match="parameter 'emb': scale_grad_by_freq"):
        _table(group, worker, _weight(), sparse_grad=True,
               batch_dependent=BatchDependent(scale_grad_by_freq=True))


def _prefetched_rows(table: ShardedTable) -> Tensor:
    """The leaf rows ``table``'s last prefetch pulled for this step."""
    return table.steps.current.prefetched[table.name].rows
