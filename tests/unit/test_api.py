"""The user surface outside a running cluster: shard, plan and optimizer checks."""

from __future__ import annotations

import json
import os

import pytest
import torch
from equivalence_cases import Mixed, TiedLM
from torch.utils.data import DataLoader, TensorDataset

import parallax
from parallax.engine.optimizers.shard_optimizer import as_optimizer_list
from parallax.engine.tables.sharding import (
    POOLED,
    POOLED_BY_ROWS,
    ROWS,
    SHARDINGS,
    PooledByColumns,
    Sharding,
)
from parallax.model.detect import find_sparse_parameters
from parallax.planning import link
from parallax.planning.plan import Plan


def _fake_worker(monkeypatch: pytest.MonkeyPatch, rank: int, world: int) -> None:
    monkeypatch.delenv("PARALLAX_RESOURCES", raising=False)
    for key, value in dict(RANK=rank, WORLD_SIZE=world, LOCAL_RANK=rank,
                           LOCAL_WORLD_SIZE=world, GROUP_RANK=0).items():
        monkeypatch.setenv(key, str(value))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_sharded_batches_together_are_the_global_batch(monkeypatch, world: int) -> None:
    data = TensorDataset(torch.arange(64))
    per_worker = 16 // world
    sharded = []
    for rank in range(world):
        _fake_worker(monkeypatch, rank, world)
        sharded.append([b[0] for b in parallax.shard(DataLoader(data, batch_size=per_worker))])
    single = [b[0] for b in DataLoader(data, batch_size=16)]
    assert len(sharded[0]) == len(single)
    for k, batch in enumerate(single):
        together = torch.cat([sharded[r][k] for r in range(world)])
        assert sorted(together.tolist()) == batch.tolist()


def test_shuffled_shards_are_disjoint_and_reshuffle_each_epoch(monkeypatch) -> None:
    data = TensorDataset(torch.arange(40))
    epochs = []
    for rank in range(2):
        _fake_worker(monkeypatch, rank, 2)
        loader = parallax.shard(DataLoader(data, batch_size=5, shuffle=True))
        epochs.append([torch.cat([b[0] for b in loader]).tolist() for _ in range(2)])
    assert sorted(epochs[0][0] + epochs[1][0]) == list(range(40))
    assert epochs[0][0] != epochs[0][1], "a new epoch must bring a new order"


def test_shard_outside_a_cluster_is_the_loader_itself(monkeypatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "PARALLAX_RESOURCES"):
        monkeypatch.delenv(key, raising=False)
    loader = DataLoader(TensorDataset(torch.arange(4)), batch_size=2)
    assert parallax.shard(loader) is loader


def test_plan_table_and_json_name_every_parameter() -> None:
    model = Mixed()
    sparse = find_sparse_parameters(model)
    plan = Plan.build(model, sparse, placements={n: ("ps", 2, (0, 2)) for n in sparse},
                      world_size=4, num_machines=2)
    table = plan.table()
    assert "embedding.weight" in table and "PS: 2 partition(s) on server rank(s) 0,2" in table
    assert "hidden.weight" in table and "replicated, AllReduce" in table
    parsed = json.loads(plan.to_json())
    assert {p["name"] for p in parsed["parameters"]} == {n for n, _ in model.named_parameters()}


@pytest.mark.parametrize("sharding", [ROWS, POOLED, POOLED_BY_ROWS, PooledByColumns(2)],
                         ids=lambda s: s.name)
def test_the_plan_records_each_tables_sharding_by_name(sharding: Sharding) -> None:
    """A table's sharding is one value: the plan records its name (None for a parameter no
    table holds), and pooling by rows or columns predicts every server pooling."""
    model = Mixed()
    sparse = find_sparse_parameters(model)
    plan = Plan.build(model, sparse, placements={n: ("ps", 2, (0, 2)) for n in sparse},
                      world_size=4, num_machines=2, shardings=dict.fromkeys(sparse, sharding))
    parsed = {p["name"]: p for p in json.loads(plan.to_json())["parameters"]}
    assert {parsed[n]["sharding"] for n in sparse} == {sharding.name}
    assert parsed["hidden.weight"]["sharding"] is None
    assert SHARDINGS[sharding.name] is type(sharding)
    with pytest.raises(parallax.ArgumentError, match="1 or more slices"):
        PooledByColumns(0)


def test_plan_times_are_its_bytes_at_the_link_rate() -> None:
    model = Mixed()
    sparse = find_sparse_parameters(model)
    build = dict(placements={n: ("ps", 2, (0, 2)) for n in sparse}, world_size=4)
    unknown = Plan.build(model, sparse, num_machines=2, **build)
    assert "predicted link time per step: ? (the link is measured after the warm-up" \
        in unknown.table()
    plan = Plan.build(model, sparse, num_machines=2, link=link.given(0.5), **build)
    parsed = json.loads(plan.to_json())
    assert parsed["link"]["bytes_per_s"] == 2 * 0.5e9 / 8  # both ways of 0.5 Gbit/s
    for p in parsed["parameters"]:
        for name, seconds in p["predicted_seconds"].items():
            bytes_ = p["predicted_bytes"][name]
            assert seconds == (None if bytes_ is None else bytes_ / 125e6), (p["name"], name)
    dense = next(p for p in parsed["parameters"] if p["name"] == "hidden.weight")
    assert f"{dense['predicted_seconds']['hybrid'] * 1e6:.1f} us" in plan.table()
    assert "hybrid link time/step" in plan.table()
    assert "link 0.5 Gbit/s each way (Config.link_gbit)" in plan.table()
    alone = Plan.build(model, sparse, num_machines=1, link=None, **build)
    assert "predicted link time per step: none (one machine)" in alone.table()
    alone_dense = next(p for p in json.loads(alone.to_json())["parameters"]
                       if p["name"] == "hidden.weight")
    assert alone_dense["predicted_seconds"]["allreduce"] == 0.0
    with pytest.raises(parallax.ConfigError, match="link_gbit"):
        parallax.Config(link_gbit=0)


def test_tied_embedding_is_planned_dense() -> None:
    model = TiedLM()
    assert find_sparse_parameters(model) == {}


def test_optimizer_argument_is_checked() -> None:
    model = Mixed()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    assert as_optimizer_list(sgd) == [sgd]
    with pytest.raises(TypeError, match=r"optimizer\[1\] must be a torch.optim.Optimizer"):
        as_optimizer_list([sgd, "adam"])


def test_config_round_trips_through_a_dict() -> None:
    config = parallax.Config(clip_grad_norm=2.5, num_partitions=3, average_sparse=False)
    assert parallax.Config.from_dict(config.to_dict()) == config


def test_lookup_ids_are_integers_deduplicated_and_range_checked() -> None:
    from parallax.engine.tables.exchange import unique_ids

    unique, inverse, bad = unique_ids(torch.tensor([[3, 1], [3, 7]]), 10, "emb", 0)
    assert unique.tolist() == [1, 3, 7] and torch.equal(unique[inverse],
                                                        torch.tensor([[3, 1], [3, 7]]))
    assert bad is None
    assert unique_ids(torch.tensor([2, 10]), 10, "emb", 0)[2] == 10
    assert unique_ids(torch.tensor([-1, 2]), 10, "emb", 0)[2] == -1
    with pytest.raises(TypeError, match="parameter 'emb' on rank 3: ids must be an integer"):
        unique_ids(torch.tensor([1.0]), 10, "emb", 3)


def test_a_one_worker_run_leaves_no_launch_variables_behind(monkeypatch) -> None:
    """Else a job launched later from the same process inherits RANK=0, WORLD_SIZE=1 and every
    one of its workers trains alone (found by scripts/flake_check.sh)."""
    from torch import nn

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    model = nn.Sequential(nn.Embedding(5, 2))
    parallax.get_runner(model, torch.optim.SGD(model.parameters(), lr=0.1),
                        lambda out, y: out.sum())
    assert os.environ["WORLD_SIZE"] == "1"
    parallax.shutdown()
    assert not {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"} & set(os.environ)


@pytest.mark.parametrize(("loss_fn", "error", "words"), [
    (lambda out, y: (out.sum(), {"acc": 1.0}), parallax.ArgumentTypeError,
     "rank 0: get_runner's loss_fn returned tuple"),
    (lambda out, y: torch.nn.functional.mse_loss(out, y, reduction="none"),
     parallax.ArgumentError, "a tensor of shape (4, 3)"),
    (lambda out, y: out.detach().sum(), parallax.ArgumentError, "without autograd"),
])
def test_runner_step_names_a_loss_fn_that_returns_no_loss(single_process, loss_fn, error,
                                                         words: str) -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(6, 3), torch.nn.Linear(3, 3))
    runner = parallax.get_runner(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn,
                                 config=parallax.Config(partition_cache=None))
    with pytest.raises(error) as raised:
        runner.step((torch.tensor([0, 1, 2, 3]), torch.zeros(4, 3)))
    assert words in str(raised.value)
