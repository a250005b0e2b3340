"""The bytes model reduces to the papers' Table 3 with one worker per machine."""

from __future__ import annotations

import pytest
import torch

from parallax.planning import cost

W, ROW = 1_000_000.0, 400.0  # a 1 MB table of 400-byte rows


@pytest.mark.parametrize("machines", [2, 4, 8])
def test_table3_with_one_worker_per_machine(machines: int) -> None:
    shape = cost.Shape(machines, 1)
    n = machines
    overhead = cost.count_messages(shape, 1)
    assert cost.allreduce_dense(W, shape) == pytest.approx(4 * W * (n - 1) / n)
    alpha = 0.1
    rows = alpha * W / ROW
    # PS sparse: 4αw(N-1)/N plus the ids (int32 on the wire, sent once).
    want = 4 * alpha * W * (n - 1) / n + 2 * rows * (n - 1) / n * cost.ID_BYTES
    assert cost.ps_rows(rows, ROW, shape, local_aggregation=False) == pytest.approx(
        want + overhead)
    # AllGatherv: 2αw(N-1) plus the ids.
    want = 2 * alpha * W * (n - 1) + 2 * rows * (n - 1) * cost.REPLICA_ID_BYTES
    assert cost.allgatherv_rows(rows, ROW, shape) == pytest.approx(
        want + cost.count_messages(shape, 2))


def test_one_machine_moves_nothing_across_machines() -> None:
    shape = cost.Shape(1, 4)
    assert cost.allreduce_dense(W, shape) == 0
    assert cost.ps_rows(100, ROW, shape, local_aggregation=True) == 0


@pytest.mark.parametrize("machines,workers", [(2, 2), (4, 2), (2, 4)])
def test_allreduce_crosses_machines_once_per_machine(machines: int, workers: int) -> None:
    # Reduced inside each machine first: the workers per machine do not add link bytes.
    n = machines
    assert cost.allreduce_dense(W, cost.Shape(machines, workers)) == pytest.approx(
        4 * W * (n - 1) / n)


@pytest.mark.parametrize("machines,workers", [(2, 1), (2, 2), (4, 2), (2, 4)])
def test_a_flat_ring_leaves_and_enters_each_machine_once(machines: int, workers: int) -> None:
    """``dense_sync="flat"``: one ring over all W ranks, each machine's ranks consecutive in
    it, whatever the payload's size (DDP's flat hook sums no payload by all_to_all)."""
    shape = cost.Shape(machines, workers, small_sums=True, flat_dense=True)
    world = machines * workers
    for size in (W, 64.0):
        assert cost.allreduce_dense(size, shape, flat=True) == pytest.approx(
            4 * size * (world - 1) / world)
    # one worker per machine: the ring is the machines' ring, Table 3's figure
    if workers == 1:
        assert cost.allreduce_dense(W, shape, flat=True) == cost.allreduce_dense(W, shape)
    assert cost.allreduce_dense(W, cost.Shape(1, workers), flat=True) == 0


def test_the_plan_predicts_the_flat_ring_for_dense_parameters_only() -> None:
    """A run with ``dense_sync="flat"``: its dense parameters' AllReduce column is the flat
    ring's; a sparse table summed as a replica keeps the machine-by-machine sum."""
    from types import SimpleNamespace

    from parallax.planning.architectures import Hybrid

    shape = cost.Shape(2, 2, flat_dense=True)
    dense = SimpleNamespace(sparse=False, sync="allreduce", total=W, payload=W)
    replica = SimpleNamespace(sparse=True, sync="allreduce", total=W, payload=None)
    assert Hybrid().predicted_bytes(dense, shape, local_aggregation=None) == pytest.approx(3 * W)
    assert Hybrid().predicted_bytes(replica, shape, local_aggregation=None) == pytest.approx(
        2 * W)


def _aggregating_table(rows: int = 10_000) -> object:
    from types import SimpleNamespace

    return SimpleNamespace(on_servers=True, local_aggregation=True, dtype=torch.float32,
                           row_shape=(32,), num_rows=rows)


@pytest.mark.parametrize("shared,keep", [(0.0, False), (0.1, False), (0.6, True), (1.0, True)])
def test_hybrid_keeps_the_leader_hop_only_where_merging_saves_enough(shared: float,
                                                                     keep: bool) -> None:
    """2 workers per machine using 1 % of the rows each, ``shared`` of them in common:
    merging saves about shared / 2 of the bytes; the threshold is 20 %."""
    from types import SimpleNamespace

    from parallax import Config
    from parallax.planning.architectures import MIN_AGGREGATION_SAVING, Hybrid
    from parallax.planning.sparsity import Sparsity

    worker = SimpleNamespace(server_ranks=(0, 2), world_size=4, device=torch.device("cpu"))
    measured = {"t": Sparsity(alpha=0.01, alpha_machine=0.01 * (2 - shared))}
    tables = {"t": _aggregating_table()}
    kept, why = Hybrid().keeps_local_aggregation(tables, measured, config=Config(),
                                                 worker=worker)
    assert kept is keep and (shared / 2 >= MIN_AGGREGATION_SAVING) is keep
    assert ("kept" if keep else "off") in why
    # an explicit Config.local_aggregation is obeyed whatever α_m says
    for forced in (True, False):
        assert Hybrid().keeps_local_aggregation(
            tables, measured, config=Config(local_aggregation=forced), worker=worker)[0] is forced


def test_small_sums_on_cpu_cost_a_copy_to_every_other_machines_worker() -> None:
    """Under ``small_sums`` a payload within `reduction.small` goes by one all_to_all (each
    of a machine's k workers sends it to the W - k remote workers and receives as much); a
    larger one, or a piece of a larger payload, keeps the ring's Table 3 figure."""
    from parallax.engine.tables import reduction

    shape = cost.Shape(2, 2, small_sums=True)
    small = 4096.0
    assert reduction.small(small, shape.world)
    assert cost.allreduce_dense(small, shape) == 2 * 2 * 2 * small
    assert cost.allreduce_dense(small, cost.Shape(2, 2)) == 2 * small  # the papers' ring
    large = float(reduction.ALL_TO_ALL_MAX_SENT_BYTES)  # x (W - 1) > the bound
    assert cost.allreduce_dense(large, shape) == 2 * large
    assert cost.allreduce_dense(small, shape, payload=large) == 2 * small
    assert not reduction.small(small, 1)  # one rank sums nothing


def test_largest_first_places_on_the_least_loaded_server_that_fits() -> None:
    from parallax.planning.architectures import largest_first

    sizes = {"a": 50, "b": 40, "c": 30, "d": 10}
    assert largest_first(dict(sizes), [0, 0]) == {"a": 0, "b": 1, "c": 1, "d": 0}
    room = [60, 45]

    def fits(name: str, server: int) -> bool:
        if sizes[name] > room[server]:
            return False
        room[server] -= sizes[name]
        return True

    load = [0, 0]
    # "c" fits neither server once "a" and "b" are placed: left out, and adds no load
    assert largest_first(dict(sizes), load, fits=fits) == {"a": 0, "b": 1, "d": 0}
    assert load == [60, 40] and room == [0, 5]


def test_the_rest_pools_only_where_every_table_can_and_bytes_stay_near() -> None:
    from parallax.planning.architectures import MAX_POOLED_REST_EXTRA_BYTES, pool_the_rest

    assert pool_the_rest({"a": (100.0, 120.0), "b": (50.0, 40.0)})[0]
    assert not pool_the_rest({"a": (100.0, 120.0), "b": None})[0]  # b would still pull rows
    assert not pool_the_rest({})[0]  # nothing left to pool
    extra = MAX_POOLED_REST_EXTRA_BYTES
    assert pool_the_rest({"a": (100.0, 100.0 + extra)})[0]
    assert not pool_the_rest({"a": (100.0, 101.0 + extra)})[0]
