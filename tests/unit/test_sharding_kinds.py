"""The sharding kinds' contract (`parallax.engine.tables.sharding`): each pooled kind says who
pools a call, each owner's share and how the worker joins the shares; the kinds that do not
pool refuse to be asked. One device's ``F.embedding_bag`` is the reference."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from parallax.engine.tables.partitioning import RowPartitioning
from parallax.engine.tables.sharding import (
    OWN,
    POOLED,
    POOLED_BY_ROWS,
    REPLICATED,
    ROWS,
    SHARDINGS,
    PooledByColumns,
    Pooling,
)
from parallax.errors import InternalError, UnsupportedProgramError

SERVERS = (0, 1, 2)


@dataclass
class _Table:
    num_rows: int
    partitioning: RowPartitioning


@dataclass
class _Call:
    table: _Table
    ids: Tensor
    offsets: Tensor
    weights: Tensor | None
    mode: str
    padding_idx: int | None

    @property
    def bags(self) -> int:
        return self.offsets.numel()

    @property
    def starts(self) -> Tensor:
        return self.offsets


def _call(mode: str, partitions: int, padding_idx: int | None = None) -> _Call:
    table = _Table(12, RowPartitioning(12, partitions, SERVERS, first_server=1))
    return _Call(table, torch.tensor([0, 5, 7, 5, 11, 3, 3, 8]), torch.tensor([0, 3, 3, 6]),
                 None, mode, padding_idx)


def _pooled_by_owners(kind: Pooling, call: _Call, weight: Tensor) -> Tensor:
    """The call through ``kind``: each owner pools its share of the whole table's rows in
    the kind's owner mode, the worker joins them."""
    owners = kind.owners(call.table.partitioning)
    shares = kind.shares(call, owners, refused=False)
    mode = kind.owner_mode(call.mode, len(owners))
    pooled = [F.embedding_bag(share.ids, weight, share.starts, mode=mode,
                              padding_idx=call.padding_idx) for share in
              (shares[owner] for owner in owners)]
    return kind.added(call, torch.cat(pooled), owners)


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("padding_idx", [None, 5])
def test_whole_and_by_rows_pool_as_one_device(mode: str, padding_idx: int | None) -> None:
    weight = torch.randn(12, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for kind, partitions, owners in ((POOLED, 1, [1]), (POOLED_BY_ROWS, 3, [0, 1, 2]),
                                     (POOLED_BY_ROWS, 1, [1])):
        call = _call(mode, partitions, padding_idx)
        assert kind.owners(call.table.partitioning) == owners
        expected = F.embedding_bag(call.ids, weight, call.offsets, mode=mode,
                                   padding_idx=padding_idx)
        torch.testing.assert_close(_pooled_by_owners(kind, call, weight), expected,
                                   rtol=1e-12, atol=1e-12)


def test_by_rows_splits_a_call_by_owner_and_refuses_max() -> None:
    call = _call("sum", 3)
    shares = POOLED_BY_ROWS.shares(call, [0, 1, 2], refused=False)
    owner = call.table.partitioning.owner_rank(call.ids)
    for rank, share in shares.items():
        assert torch.equal(share.ids, call.ids[owner == rank])
    assert all(s.ids.numel() == 0 for s in POOLED_BY_ROWS.shares(call, [0, 1, 2],
                                                                 refused=True).values())
    assert POOLED_BY_ROWS.owner_mode("mean", 3) == "sum" and POOLED.owner_mode("max", 1) == "max"
    with pytest.raises(UnsupportedProgramError, match=r"^rank 2: parameter 'emb' is pooled "
                                                      r"by rows .* mode='max'"):
        POOLED_BY_ROWS.check_mode("emb", 2, "max")
    POOLED.check_mode("emb", 2, "max")  # pooled whole: a max is exact


def test_column_slices_go_to_their_servers_and_sit_side_by_side_in_slice_order() -> None:
    kind = PooledByColumns(3)
    partitioning = RowPartitioning(12 * 3, 3, SERVERS, first_server=1)  # slice k: server k+1
    assert kind.owners(partitioning) == [0, 1, 2]
    assert [kind.column(partitioning, rank) for rank in (1, 2, 0)] == [0, 1, 2]
    call = _Call(_Table(36, partitioning), torch.tensor([1, 2]), torch.tensor([0, 1]), None,
                 "max", None)
    shares = kind.shares(call, [0, 1, 2], refused=False)
    assert all(torch.equal(s.ids, call.ids) for s in shares.values())  # every id, every slice
    by_rank = torch.stack([torch.full((2, 1), float(rank)) for rank in (0, 1, 2)])
    joined = kind.added(call, by_rank.reshape(6, 1), [0, 1, 2])
    assert joined.tolist() == [[1.0, 2.0, 0.0]] * 2  # slices 0, 1, 2: ranks 1, 2, 0
    assert PooledByColumns(1).owners(partitioning) == [1]


@pytest.mark.parametrize("kind", [ROWS, REPLICATED, OWN])
def test_a_kind_that_does_not_pool_refuses_to_say_how(kind) -> None:
    assert not kind.pools
    with pytest.raises(InternalError, match=f"sharded as '{kind.name}'"):
        kind.owners(RowPartitioning(4, 1, SERVERS))


def test_every_pooling_kind_of_the_registry_answers_the_contract() -> None:
    pooling = {name for name, kind in SHARDINGS.items() if kind.pools}
    assert pooling == {"pooled", "pooled_by_rows", "pooled_by_columns"}
    assert all(issubclass(SHARDINGS[name], Pooling) for name in pooling)


def test_every_kind_a_program_can_pin_or_an_architecture_default_to_is_built_by_one_class() -> None:
    from parallax.config import ShardingName
    from parallax.planning.architectures import ARCHITECTURES
    from parallax.planning.table_kinds import REPLICATED_KIND, TABLE_KINDS, _kind_name

    # every name Config.sharding takes, and the replica, has its builder under its word
    assert set(TABLE_KINDS) == {*map(str, ShardingName), REPLICATED_KIND}
    assert set(TABLE_KINDS) <= set(SHARDINGS)
    assert len({type(kind) for kind in TABLE_KINDS.values()}) == len(TABLE_KINDS)
    for name, architecture in ARCHITECTURES.items():
        default = ShardingName.ROWS if architecture.sparse_on_servers else REPLICATED_KIND
        assert _kind_name("t", {}, architecture) == default, name
        assert _kind_name("t", {"t": (ShardingName.ROWS, "sharding")}, architecture) == default
        # the owners hold a pooled table's bags whatever the architecture; pooling by rows
        # needs the rows on the servers
        for pooled in (ShardingName.POOLED, ShardingName.POOLED_BY_COLUMNS):
            assert _kind_name("t", {"t": (pooled, "sharding")}, architecture) == pooled, name
        assert _kind_name("t", {"t": (ShardingName.POOLED_BY_ROWS, "sharding")},
                          architecture) == (ShardingName.POOLED_BY_ROWS
                                            if architecture.sparse_on_servers
                                            else REPLICATED_KIND), name
