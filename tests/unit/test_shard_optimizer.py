"""The user's optimizer applied per shard (`parallax.engine.optimizers.shard_optimizer`): a server's
update of its partitions must equal the user's optimizer stepping the whole parameter on one
device with the same gradient, and the optimizers that cannot do that are refused by name.

In a world of one the only server holds every row (split into partitions), so its table,
gathered by `full_weight`, can be compared with the user's parameter stepped by the user's own
optimizer."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from parallax.cluster import WorkerInfo
from parallax.engine.optimizers import deferred_sgd, shard_optimizer
from parallax.engine.optimizers.shard_optimizer import (
    ShardOptimizer,
    as_optimizer_list,
    check_lazy,
    check_per_shard,
    deferrable_sgd,
    optimizer_of,
    zero_gradient_is_identity,
)
from parallax.engine.tables.exchange import Traffic
from parallax.engine.tables.row_exchange import pull
from parallax.engine.tables.server_table import ShardedTable
from parallax.engine.tables.step_context import TableSteps
from parallax.errors import OptimizerError

Factory = Callable[[list[dict]], torch.optim.Optimizer]

DENSE_OPTIMIZERS: dict[str, Factory] = {
    "sgd": lambda groups: torch.optim.SGD(groups, lr=0.1),
    "sgd-momentum": lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True,
                                                   weight_decay=0.01),
    "adagrad": lambda groups: torch.optim.Adagrad(groups, lr=0.1, lr_decay=0.01, eps=1e-6),
    "adam": lambda groups: torch.optim.Adam(groups, lr=0.01, amsgrad=True),
}
LAZY_OPTIMIZERS: dict[str, Factory] = {  # those that take sparse gradients
    "sgd-momentum": lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9),
    "adagrad": lambda groups: torch.optim.Adagrad(groups, lr=0.1),
    "sparse-adam": lambda groups: torch.optim.SparseAdam(groups, lr=0.01),
}


def _user_model(factory: Factory) -> tuple[nn.Parameter, nn.Parameter, torch.optim.Optimizer]:
    """An embedding weight and another parameter, in two param groups of different lr (the
    weight's group second, so taking the wrong group's hyper-parameters shows)."""
    generator = torch.Generator().manual_seed(0)
    weight = nn.Parameter(torch.randn(10, 3, dtype=torch.float64, generator=generator))
    other = nn.Parameter(torch.randn(4, dtype=torch.float64, generator=generator))
    optimizer = factory([{"params": [other], "lr": 1.0}, {"params": [weight]}])
    optimizer.param_groups[1]["lr"] *= 0.5
    return weight, other, optimizer


def _table(group: dist.ProcessGroup, worker: WorkerInfo, weight: Tensor, *, name: str = "emb",
           partitions: int, sparse_grad: bool) -> ShardedTable:
    return ShardedTable(name, weight, num_partitions=partitions, worker=worker, group=group,
                        traffic=Traffic(worker.rank, worker.machine_of_rank),
                        sparse_grad=sparse_grad, average=True)


def _batches(steps: int, seed: int = 1) -> list[tuple[Tensor, Tensor]]:
    """Per step: ids (with repeats; most rows unused) and the loss coefficients."""
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randint(10, (2, 3), generator=generator),
             torch.randn(2, 3, 3, dtype=torch.float64, generator=generator))
            for _ in range(steps)]


def _server_step(table: ShardedTable, servers: ShardOptimizer, ids: Tensor,
                 coefficient: Tensor) -> None:
    table.zero_grad()
    rows, inverse = table.lookup(ids)
    (rows[inverse] * coefficient).sum().backward()
    table.push_gradients()
    servers.step()


def _reference_step(weight: nn.Parameter, optimizer: torch.optim.Optimizer, ids: Tensor,
                    coefficient: Tensor, sparse: bool) -> None:
    optimizer.zero_grad()
    (F.embedding(ids, weight, sparse=sparse) * coefficient).sum().backward()
    optimizer.step()


@pytest.mark.parametrize("partitions", [1, 3])
@pytest.mark.parametrize(("optimizer", "sparse_grad"),
                         [(name, False) for name in DENSE_OPTIMIZERS]
                         + [(name, True) for name in LAZY_OPTIMIZERS])
def test_server_update_equals_the_user_optimizer_on_one_device(
        group, worker, optimizer: str, sparse_grad: bool, partitions: int) -> None:
    """Server updates equal the user's optimizer on one device, with the param group's settings."""
    factory = (LAZY_OPTIMIZERS if sparse_grad else DENSE_OPTIMIZERS)[optimizer]
    weight, other, user = _user_model(factory)
    table = _table(group, worker, weight, partitions=partitions, sparse_grad=sparse_grad)
    servers = ShardOptimizer([user], {id(weight): table})
    start = weight.detach().clone()
    for ids, coefficient in _batches(3):
        _server_step(table, servers, ids, coefficient)
        _reference_step(weight, user, ids, coefficient, sparse_grad)
    assert not torch.allclose(weight.detach(), start)
    torch.testing.assert_close(table.full_weight(), weight.detach())
    assert other.grad is None


@pytest.mark.parametrize(("factory", "touched_only"), [
    (lambda g: torch.optim.SGD(g, lr=0.1), True),
    (lambda g: torch.optim.SGD(g, lr=0.1, dampening=0.5, maximize=True), True),
    (lambda g: torch.optim.Adagrad(g, lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1),
     True),
    # the foreach form (a GPU's default), which the rows' step follows
    (lambda g: torch.optim.Adagrad(g, lr=0.1, lr_decay=0.01, foreach=True), True),
    (lambda g: torch.optim.Adagrad(g, lr=0.1, weight_decay=0.01), False),
    (lambda g: torch.optim.Adam(g, lr=0.1), False),
])
def test_only_touched_rows_are_updated_where_a_zero_gradient_changes_nothing(
        group, worker, factory: Factory, touched_only: bool) -> None:
    """Dense-gradient tables under plain SGD and Adagrad without weight decay: the touched
    rows alone are stepped (the optimizer's functional update, the partition hidden from the
    servers' ``step()``), the other rows and their state stay bitwise as they were, and the
    result is the dense single-device update's, to the bit. Every other optimizer keeps the
    dense update."""
    weight, other, user = _user_model(factory)
    assert zero_gradient_is_identity(user, user.param_groups[1]) is touched_only
    table = _table(group, worker, weight, partitions=3, sparse_grad=False)
    servers = ShardOptimizer([user], {id(weight): table})
    calls: list[list[bool]] = []  # per server step() called: each part's gradient hidden
    for server_opt, _, _ in servers._slots:
        def recording(step=server_opt.step, opt=server_opt):
            calls.append([p.grad is None for g in opt.param_groups for p in g["params"]])
            return step()
        server_opt.step = recording
    for ids, coefficient in _batches(3):
        before = table.full_weight()
        state_before = {k: v.clone() for k, v in servers.table_state(table).items()}
        _server_step(table, servers, ids, coefficient)
        _reference_step(weight, user, ids, coefficient, sparse=False)
        untouched = torch.ones(10, dtype=torch.bool)
        untouched[ids.unique()] = False
        if touched_only:
            assert torch.equal(table.full_weight()[untouched], before[untouched])
            for key, value in servers.table_state(table).items():
                if key in state_before and value.dim() > 0:  # per row, in shard order
                    rows = table.partitioning.rows_of_server(0)
                    assert torch.equal(value[untouched[rows]], state_before[key][
                        untouched[rows]]), key
        assert all(part.grad is not None for part in table.parts)  # dense gradients back
    # (a partition whose every row was touched keeps its dense gradient: nothing to skip);
    # a server step() with every part hidden would step nothing: it is not called
    hidden_or_skipped = (3 * len(servers._slots) - len(calls)
                         + sum(any(parts) for parts in calls))
    assert (hidden_or_skipped > 0) is touched_only
    assert not any(all(parts) for parts in calls)
    assert torch.equal(table.full_weight(), weight.detach())


@pytest.mark.parametrize("make", [
    lambda groups: torch.optim.SGD(groups, lr=0.1),
    lambda groups: torch.optim.Adagrad(groups, lr=0.1, lr_decay=0.01),
    lambda groups: torch.optim.Adagrad(groups, lr=0.1, foreach=True),
])
@pytest.mark.parametrize("partitions", [1, 3])
def test_a_param_groups_tables_take_one_row_update_per_partition_slot(
        group, worker, monkeypatch, make: Factory, partitions: int) -> None:
    """Three tables, two in one param group and one in another: each step updates the
    touched rows of a param group's tables in one functional call per partition slot (one
    call per group with one partition), with no server ``step()`` left to run, and every
    table ends as the user's optimizer steps it on one device, to the bit."""
    generator = torch.Generator().manual_seed(0)
    weights = [nn.Parameter(torch.randn(10, 3, dtype=torch.float64, generator=generator))
               for _ in range(3)]
    user = make([{"params": weights[:2]}, {"params": weights[2:], "lr": 0.05}])
    steps = TableSteps()  # (one run's tables: one exchange)
    tables = [ShardedTable(f"t{i}", w, num_partitions=partitions, worker=worker, group=group,
                           traffic=Traffic(0, (0,)), sparse_grad=False, average=True,
                           steps=steps)
              for i, w in enumerate(weights)]
    servers = ShardOptimizer([user], {id(w): t for w, t in zip(weights, tables, strict=True)})
    calls: list[list[str]] = []
    real = shard_optimizer.update_rows
    names = {id(part): table.name for table in tables for part in table.parts}
    monkeypatch.setattr(shard_optimizer, "update_rows", lambda cls, hyper, steps: (
        calls.append(sorted(names[id(step.param)] for step in steps)),
        real(cls, hyper, steps))[1])
    stepped: list[int] = []
    for server_opt, _, _ in servers._slots:
        def recording(step=server_opt.step):
            stepped.append(1)
            return step()
        server_opt.step = recording
    for step, (ids, coefficient) in enumerate(_batches(3)):
        calls.clear()
        for table in tables:
            table.zero_grad()
        looked_up = pull(tables, [(ids + 3 * k) % 10 for k in range(3)])
        sum(((rows[inverse] * coefficient).sum() for rows, inverse in looked_up)).backward()
        ShardedTable.push_together(tables)
        servers.step()
        user.zero_grad()
        sum((F.embedding((ids + 3 * k) % 10, w) * coefficient).sum()
            for k, w in enumerate(weights)).backward()
        user.step()
        if partitions == 1:  # (with 3 a partition may have every row touched: kept dense)
            assert sorted(calls) == [["t0", "t1"], ["t2"]], step
    assert bool(stepped) is (partitions > 1)  # one partition: every part stepped at its rows
    for table, weight in zip(tables, weights, strict=True):
        assert torch.equal(table.full_weight(), weight.detach())


def test_adagrad_initial_accumulator_value_reaches_the_servers(group, worker) -> None:
    """Adagrad's initial_accumulator_value reaches the servers' accumulators."""
    weight, _, user = _user_model(
        lambda groups: torch.optim.Adagrad(groups, lr=0.1, initial_accumulator_value=0.1))
    table = _table(group, worker, weight, partitions=3, sparse_grad=False)
    servers = ShardOptimizer([user], {id(weight): table})
    ((ids, coefficient),) = _batches(1)
    _server_step(table, servers, ids, coefficient)
    _reference_step(weight, user, ids, coefficient, False)
    torch.testing.assert_close(table.full_weight(), weight.detach())


def test_lr_changes_on_the_user_optimizer_reach_the_servers(group, worker) -> None:
    """An lr scheduler stepping the user's optimizer changes the servers' lr before each step."""
    weight, _, user = _user_model(DENSE_OPTIMIZERS["sgd-momentum"])
    table = _table(group, worker, weight, partitions=2, sparse_grad=False)
    servers = ShardOptimizer([user], {id(weight): table})
    scheduler = torch.optim.lr_scheduler.StepLR(user, step_size=1, gamma=0.1)
    for ids, coefficient in _batches(3):
        _server_step(table, servers, ids, coefficient)
        _reference_step(weight, user, ids, coefficient, False)
        scheduler.step()
    assert user.param_groups[1]["lr"] == pytest.approx(0.05 * 0.1 ** 3)
    torch.testing.assert_close(table.full_weight(), weight.detach())


def test_each_table_is_updated_by_its_own_user_optimizer(group, worker) -> None:
    """With several user optimizers, each server table follows the one holding its parameter."""
    generator = torch.Generator().manual_seed(3)
    emb = nn.Parameter(torch.randn(10, 3, dtype=torch.float64, generator=generator))
    pos = nn.Parameter(torch.randn(10, 3, dtype=torch.float64, generator=generator))
    sparse_adam = torch.optim.SparseAdam([emb], lr=0.05)
    adam = torch.optim.Adam([pos], lr=0.02, weight_decay=0.1)
    tables = {"emb": _table(group, worker, emb, name="emb", partitions=3, sparse_grad=True),
              "pos": _table(group, worker, pos, name="pos", partitions=2, sparse_grad=False)}
    servers = ShardOptimizer(as_optimizer_list([sparse_adam, adam]),
                             {id(emb): tables["emb"], id(pos): tables["pos"]})
    for ids, coefficient in _batches(3):
        loss = torch.zeros((), dtype=torch.float64)
        for table in tables.values():
            table.zero_grad()
            rows, inverse = table.lookup(ids)
            loss = loss + (rows[inverse] * coefficient).sum()
        loss.backward()
        for table in tables.values():
            table.push_gradients()
        servers.step()
        for optimizer in (sparse_adam, adam):
            optimizer.zero_grad()
        ((F.embedding(ids, emb, sparse=True) + F.embedding(ids, pos)) * coefficient).sum(
            ).backward()
        sparse_adam.step()
        adam.step()
    torch.testing.assert_close(tables["emb"].full_weight(), emb.detach())
    torch.testing.assert_close(tables["pos"].full_weight(), pos.detach())


def test_table_state_joins_the_partitions_state_in_shard_order(group, worker) -> None:
    """table_state joins the partitions' per-row state in shard order, equal to one device's."""
    weight, _, user = _user_model(DENSE_OPTIMIZERS["adam"])
    table = _table(group, worker, weight, partitions=3, sparse_grad=False)
    servers = ShardOptimizer([user], {id(weight): table})
    for ids, coefficient in _batches(2):
        _server_step(table, servers, ids, coefficient)
        _reference_step(weight, user, ids, coefficient, False)
    state = servers.table_state(table)
    reference = user.state[weight]
    order = table.partitioning.rows_of_server(0)
    assert set(state) == set(reference)
    for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
        assert state[key].shape == table.shard.shape
        torch.testing.assert_close(state[key], reference[key][order])
    assert float(state["step"]) == float(reference["step"]) == 2.0


def test_set_table_state_resumes_under_another_partitioning(group, worker) -> None:
    """set_table_state: a shard's saved state, reordered to a new partitioning, resumes exactly."""
    weight, _, user = _user_model(DENSE_OPTIMIZERS["adam"])
    first = _table(group, worker, weight, partitions=3, sparse_grad=False)
    servers = ShardOptimizer([user], {id(weight): first})
    batches = _batches(3)
    for ids, coefficient in batches[:2]:
        _server_step(first, servers, ids, coefficient)
        _reference_step(weight, user, ids, coefficient, False)
    saved, old_order = servers.table_state(first), first.partitioning.rows_of_server(0)
    resumed = _table(group, worker, first.full_weight(), partitions=2, sparse_grad=False)
    new_order = resumed.partitioning.rows_of_server(0)
    assert not torch.equal(new_order, old_order)
    state = {}
    for key, value in saved.items():  # per-row entries: shard order -> global -> new order
        if isinstance(value, Tensor) and value.shape == first.shard.shape:
            value = torch.empty_like(value).index_copy_(0, old_order, value)[new_order]
        state[key] = value
    servers = ShardOptimizer([user], {id(weight): resumed})
    servers.set_table_state(resumed, state)
    _server_step(resumed, servers, *batches[2])
    _reference_step(weight, user, *batches[2], False)
    torch.testing.assert_close(resumed.full_weight(), weight.detach())


def test_removed_table_returns_its_state_and_is_left_alone(group, worker) -> None:
    """remove_table returns the shard's optimizer state and later steps leave the table alone."""
    weight, _, user = _user_model(DENSE_OPTIMIZERS["adagrad"])
    table = _table(group, worker, weight, partitions=2, sparse_grad=False)
    servers = ShardOptimizer([user], {id(weight): table})
    (ids, coefficient), second = _batches(2)
    _server_step(table, servers, ids, coefficient)
    before = servers.table_state(table)
    removed = servers.remove_table(table)
    assert set(removed) == {"sum", "step"}
    torch.testing.assert_close(removed["sum"], before["sum"])
    frozen = table.full_weight()
    _server_step(table, servers, *second)
    assert torch.equal(table.full_weight(), frozen)


# ---- refusals ---------------------------------------------------------------------------------


def test_check_per_shard_names_the_parameter_and_optimizer() -> None:
    """check_per_shard refuses a non-element-wise optimizer (LBFGS), naming parameter and class."""
    emb, dense = nn.Parameter(torch.zeros(4, 2)), nn.Parameter(torch.zeros(2))
    lbfgs = torch.optim.LBFGS([emb])
    with pytest.raises(OptimizerError, match=r"optimizer LBFGS cannot be applied per shard to "
                                             r"the sparse parameter 'users\.weight'"):
        check_per_shard([torch.optim.Adam([dense]), lbfgs], {"users.weight": emb})
    check_per_shard([torch.optim.LBFGS([dense]), torch.optim.RMSprop([emb])],
                    {"users.weight": emb})  # LBFGS on a replicated parameter: allowed
    check_per_shard([], {"users.weight": emb})  # not optimized: nothing to refuse


def test_check_lazy_names_the_parameter_and_optimizer() -> None:
    """check_lazy refuses an optimizer without sparse gradients (Adam), naming both."""
    emb, dense = nn.Parameter(torch.zeros(4, 2)), nn.Parameter(torch.zeros(2))
    with pytest.raises(OptimizerError, match=r"lazy_sparse_updates=True\) gives the sparse "
                                             r"parameter 'emb' sparse gradients, which Adam "
                                             r"does not take"):
        check_lazy([torch.optim.Adam([emb, dense])], {"emb": emb})
    for cls in (torch.optim.SGD, torch.optim.Adagrad, torch.optim.SparseAdam):
        check_lazy([cls([emb], lr=0.1), torch.optim.Adam([dense])], {"emb": emb})


def test_optimizer_of_and_as_optimizer_list() -> None:
    """optimizer_of matches by identity; as_optimizer_list refuses non-optimizers."""
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    sgd, adam = torch.optim.SGD([a], lr=0.1), torch.optim.Adam([{"params": [b]}])
    assert optimizer_of([sgd, adam], b) is adam and optimizer_of([sgd], b) is None
    assert as_optimizer_list(sgd) == [sgd] and as_optimizer_list((sgd, adam)) == [sgd, adam]
    with pytest.raises(TypeError, match=r"optimizer\[1\] must be a torch.optim.Optimizer, "
                                        r"got str"):
        as_optimizer_list([sgd, "adam"])


DEFERRED_SGD: dict[str, Factory] = {
    "momentum": lambda g: torch.optim.SGD(g, lr=0.1, momentum=0.9),
    "nesterov-wd": lambda g: torch.optim.SGD(g, lr=0.1, momentum=0.9, nesterov=True,
                                             weight_decay=0.01),
    "dampening-wd-maximize": lambda g: torch.optim.SGD(g, lr=0.1, momentum=0.5, dampening=0.3,
                                                       weight_decay=0.05, maximize=True),
    "weight-decay": lambda g: torch.optim.SGD(g, lr=0.1, weight_decay=0.1),
}


def _shard_order(table: ShardedTable, whole: Tensor) -> Tensor:
    return whole[table.partitioning.rows_of_server(0)]


@pytest.mark.parametrize("partitions", [1, 3])
@pytest.mark.parametrize("optimizer", list(DEFERRED_SGD))
def test_sgd_with_momentum_or_weight_decay_defers_untouched_rows(
        group, worker, optimizer: str, partitions: int) -> None:
    """SGD with momentum / dampening / nesterov / weight decay / maximize and an lr that
    changes every step: the servers step the touched rows only, the other rows lag behind in
    the shard, and every read (a pull, the gathered table, the optimizer state) sees them
    caught up: equal to the dense single-device update (float64, 1e-12)."""
    factory = DEFERRED_SGD[optimizer]
    weight, _, user = _user_model(factory)
    assert not zero_gradient_is_identity(user, user.param_groups[1])
    assert deferrable_sgd(user, user.param_groups[1])
    table = _table(group, worker, weight, partitions=partitions, sparse_grad=False)
    servers = ShardOptimizer([user], {id(weight): table})
    lagged = False
    for step, (ids, coefficient) in enumerate(_batches(8)):
        _server_step(table, servers, ids, coefficient)
        _reference_step(weight, user, ids, coefficient, sparse=False)
        raw = table.shard.detach().clone()  # before any read catches rows up
        lagged |= not torch.allclose(raw, _shard_order(table, weight.detach()))
        if step % 3 == 2:  # reads in between must not disturb the deferred steps
            torch.testing.assert_close(table.full_weight(), weight.detach(),
                                       rtol=1e-12, atol=1e-12)
        for g in (user.param_groups[1],):
            g["lr"] *= 0.9
    assert lagged
    torch.testing.assert_close(table.full_weight(), weight.detach(), rtol=1e-12, atol=1e-12)
    mine = servers.table_state(table)
    if "momentum_buffer" in user.state[weight]:
        torch.testing.assert_close(mine["momentum_buffer"],
                                   _shard_order(table, user.state[weight]["momentum_buffer"]),
                                   rtol=1e-12, atol=1e-12)
    else:
        assert not mine


def test_deferred_steps_are_flushed_and_survive_assign_and_state_load(
        group, worker, monkeypatch) -> None:
    """Every FLUSH_EVERY steps all rows are brought up to date; assigning the parameter and
    loading the optimizer state apply the deferred steps first, as the single-device program
    has them applied already."""
    monkeypatch.setattr(deferred_sgd, "FLUSH_EVERY", 2)
    weight, _, user = _user_model(DEFERRED_SGD["nesterov-wd"])
    table = _table(group, worker, weight, partitions=3, sparse_grad=False)
    servers = ShardOptimizer([user], {id(weight): table})
    generator = torch.Generator().manual_seed(5)
    for step, (ids, coefficient) in enumerate(_batches(9)):
        _server_step(table, servers, ids, coefficient)
        _reference_step(weight, user, ids, coefficient, sparse=False)
        assert all(len(rows.maps) < 2 for rows in servers._deferred.values())
        if step == 3:
            new = torch.randn(10, 3, dtype=torch.float64, generator=generator)
            table.assign(new)
            with torch.no_grad():
                weight.copy_(new)
        if step == 6:
            buffer = torch.randn(10, 3, dtype=torch.float64, generator=generator)
            servers.set_table_state(table, {"momentum_buffer": _shard_order(table, buffer)})
            user.state[weight]["momentum_buffer"] = buffer.clone()
    torch.testing.assert_close(table.full_weight(), weight.detach(), rtol=1e-12, atol=1e-12)


def test_a_pull_serves_caught_up_rows(group, worker) -> None:
    """A lookup of rows that skipped steps gets their current values (the forward of the
    next step reads what the single-device parameter holds)."""
    weight, _, user = _user_model(DEFERRED_SGD["momentum"])
    table = _table(group, worker, weight, partitions=2, sparse_grad=False)
    servers = ShardOptimizer([user], {id(weight): table})
    for ids, coefficient in _batches(4):
        _server_step(table, servers, ids, coefficient)
        _reference_step(weight, user, ids, coefficient, sparse=False)
    every = torch.arange(10)
    with torch.no_grad():
        rows, inverse = table.lookup(every)
    torch.testing.assert_close(rows[inverse], weight.detach(), rtol=1e-12, atol=1e-12)


def test_adagrad_rebuilt_over_carried_state_makes_no_second_copy_of_it(monkeypatch) -> None:
    """Adagrad makes every parameter's accumulators in its constructor; a server optimizer
    rebuilt over partitions whose state is carried over (a table moved onto its owner) is
    built over storage-less stand-ins of them, so it allocates no second copy of that state,
    holds the carried tensors themselves, and steps as Adagrad with that state does."""
    from parallax.engine.optimizers.shard_optimizer import _constructed

    carried, fresh = nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.randn(4, 3))
    twin = nn.Parameter(carried.detach().clone())
    state = {"step": torch.tensor(2.0), "sum": torch.full((5, 3), 7.0)}
    made = []
    full_like = torch.full_like
    monkeypatch.setattr(torch, "full_like", lambda t, *a, **k: made.append(t.device.type)
                        or full_like(t, *a, **k))
    built = _constructed(torch.optim.Adagrad, [{"params": [carried, fresh], "lr": 0.1}],
                         {"initial_accumulator_value": 0.5}, {carried: state})
    assert made == ["meta", "cpu"]  # the carried part's stand-in, the fresh part for real
    assert built.param_groups[0]["params"][0] is carried
    assert built.param_groups[0]["params"][1] is fresh
    assert built.state[carried] is state and set(built.state) == {carried, fresh}
    assert torch.equal(built.state[fresh]["sum"], torch.full((4, 3), 0.5))
    reference = torch.optim.Adagrad([twin], lr=0.1, initial_accumulator_value=0.5)
    reference.state[twin] = {key: value.clone() for key, value in state.items()}
    for param in (carried, fresh, twin):
        param.grad = torch.ones_like(param)
    built.step()
    reference.step()
    assert torch.equal(carried, twin) and float(built.state[carried]["step"]) == 3.0


def test_servers_built_over_the_programs_adagrad_state_make_none_of_their_own(
        monkeypatch) -> None:
    """A model built as the single-device program builds it, with Adagrad (whose
    constructor makes each parameter's accumulators): the servers' optimizer is built over
    the program's state taken for each table, so it makes no accumulators of its own for
    the table's rows beside that state (it did: the program-built model's peak memory), and
    training goes on as one device's."""
    import parallax

    torch.manual_seed(0)
    reference = nn.Sequential(nn.Embedding(40, 4), nn.Flatten(), nn.Linear(8, 1))
    model = nn.Sequential(nn.Embedding(40, 4), nn.Flatten(), nn.Linear(8, 1))
    model.load_state_dict(reference.state_dict())
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1, initial_accumulator_value=0.25)
    with torch.no_grad():  # a program's state that no fresh constructor would make
        optimizer.state[model[0].weight]["sum"].uniform_(0.5, 1.5)
    one_device = torch.optim.Adagrad(reference.parameters(), lr=0.1,
                                     initial_accumulator_value=0.25)
    # (a copy: the loaded tensors would be the program's, which its dense layer updates)
    one_device.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    made = []
    full_like = torch.full_like
    monkeypatch.setattr(torch, "full_like", lambda t, *a, **k: made.append(
        (tuple(t.shape), t.device.type)) or full_like(t, *a, **k))
    runner = parallax.get_runner(model, optimizer, F.mse_loss,
                                 config=parallax.Config(alpha_threshold=1.0))
    monkeypatch.setattr(torch, "full_like", full_like)
    try:
        # the table's rows: none made for real (on the CPU, or CUDA where the runner is)
        assert [device for shape, device in made if shape == (40, 4)] == ["meta"], made
        generator = torch.Generator().manual_seed(1)
        for _ in range(4):
            ids, target = torch.randint(40, (5, 2), generator=generator), torch.rand(5, 1)
            runner.step((ids, target))
            one_device.zero_grad()
            F.mse_loss(reference(ids), target).backward()
            one_device.step()
        trained = runner.state_dict()
    finally:
        parallax.shutdown()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(trained[name].cpu(), value, rtol=1e-6, atol=1e-7, msg=name)
