"""A table's sharding: one value per table saying how its rows are held and read.

The kinds (TorchRec's sharding types where they have one):

- ``rows``: rows partitioned over the servers, the rows a step looks up pulled to the workers
  and their gradient rows pushed back (the papers' PS path);
- ``pooled``: held whole on one server, which pools every bag there (table-wise);
- ``pooled_by_rows``: rows partitioned over the servers, each pooling its rows' share of every
  bag (row-wise);
- ``pooled_by_columns``: held as column slices, one per server, each pooling its slice of
  every bag (column-wise);
- ``replicated``: a replica on every worker, its gradient rows gathered or AllReduced;
- ``own``: the program's own parameter (a world of one: nothing to exchange).

The value is the only record of the choice: the planner or `Config` sets it on the table
(its ``sharding``), the table's work follows it, and the plan records its name. A kind is one
class here and one entry in `SHARDINGS`. A pooled kind (`Pooling`) also says how a bag call
travels: which ranks pool it (`Pooling.owners`), each one's share of its ids
(`Pooling.shares`), the mode an owner pools its share in (`Pooling.owner_mode`), and how the
worker joins the owners' pooled rows (`Pooling.added`); `parallax.engine.tables.pooled` runs
the exchange around them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from parallax.engine.tables.bags import Bags, BagShare, bag_of_ids, bag_sizes
from parallax.engine.tables.partitioning import RowPartitioning
from parallax.errors import ArgumentError, InternalError, UnsupportedProgramError

__all__ = ["OWN", "POOLED", "POOLED_BY_ROWS", "REPLICATED", "ROWS", "SHARDINGS",
           "OwnParameter", "PooledByColumns", "PooledByRows", "PooledWhole", "Pooling",
           "Replicated", "RowsPulled", "Sharding"]


@dataclass(frozen=True)
class Sharding:
    """How one table's rows are held and read (a kind per class; see the module)."""

    #: the kind's name: the plan's word and `Config`'s
    name: ClassVar[str]
    #: its bags are pooled where its rows live (`parallax.engine.tables.pooled`)
    pools: ClassVar[bool] = False
    #: every server holding rows pools its share of each bag (else one owner per bag, or per
    #: column slice)
    by_rows: ClassVar[bool] = False
    #: the column slices the table is held as (1: whole rows)
    slices: ClassVar[int] = 1

    def describe(self, servers: tuple[int, ...]) -> str:
        """The plan's words for this choice on server ranks ``servers``."""
        return self.name

    # ---- a bag call's way (`Pooling`; asked only of a table that pools) ----------------
    def owners(self, partitioning: RowPartitioning) -> list[int]:
        """The ranks that pool the table's bags, in rank order."""
        raise self._not_pooling()

    def check_mode(self, name: str, rank: int, mode: str) -> None:
        """Refuse a bag ``mode`` this kind cannot pool exactly (before any exchange)."""
        raise self._not_pooling()

    def column(self, partitioning: RowPartitioning, rank: int) -> int:
        """The column slice ``rank`` holds (0: whole rows)."""
        raise self._not_pooling()

    def shares(self, call: Bags, owners: list[int], refused: bool) -> dict[int, BagShare]:
        """Each owner's share of ``call``; a call torch refuses (``refused``) sends nothing
        where it would be split (every rank raises for it once the headers are in)."""
        raise self._not_pooling()

    def owner_mode(self, mode: str, owners: int) -> str:
        """The mode an owner pools its share in, for a call of ``mode`` with ``owners``."""
        raise self._not_pooling()

    def added(self, call: Bags, shares: Tensor, owners: list[int]) -> Tensor:
        """The call's pooled rows from its ``owners``' pooled shares (``[owner, bag, ...]``
        flattened, in rank order)."""
        raise self._not_pooling()

    def _not_pooling(self) -> InternalError:
        return InternalError(f"parallax internal error: a table sharded as '{self.name}' was "
                             f"asked how it pools bags; please report it")


@dataclass(frozen=True)
class RowsPulled(Sharding):
    """Rows partitioned over the servers, pulled by the workers each step."""

    name: ClassVar[str] = "rows"

    def describe(self, servers: tuple[int, ...]) -> str:
        return "rows pulled"


@dataclass(frozen=True)
class Pooling(Sharding):
    """A kind whose bags are pooled where its rows live: by default every owner of a call
    pools all its ids in the call's mode, and the worker adds the owners' shares (their
    mean: the sum over each bag's count of ids other than the padding)."""

    pools: ClassVar[bool] = True

    def check_mode(self, name: str, rank: int, mode: str) -> None:
        return None

    def column(self, partitioning: RowPartitioning, rank: int) -> int:
        return 0

    def shares(self, call: Bags, owners: list[int], refused: bool) -> dict[int, BagShare]:
        share = BagShare(call.starts, call.ids, call.weights)
        return dict.fromkeys(owners, share)

    def owner_mode(self, mode: str, owners: int) -> str:
        return mode

    def added(self, call: Bags, shares: Tensor, owners: list[int]) -> Tensor:
        if len(owners) == 1:
            return shares
        total = shares.view(len(owners), call.bags, *shares.shape[1:]).sum(0)
        if call.mode != "mean":
            return total
        kept = (None if call.padding_idx is None
                else call.ids != call.padding_idx % call.table.num_rows)
        sizes = bag_sizes(bag_of_ids(call.starts, call.ids.numel()), kept, call.bags)
        return total / sizes.unsqueeze(1).to(total.dtype)


def _servers_holding_rows(partitioning: RowPartitioning) -> list[int]:
    return sorted({partitioning.server_ranks[partitioning.server_of_partition(p)]
                   for p in range(partitioning.num_partitions)})


@dataclass(frozen=True)
class PooledWhole(Pooling):
    """Held whole on one server, which pools every bag (TorchRec's table-wise)."""

    name: ClassVar[str] = "pooled"

    def describe(self, servers: tuple[int, ...]) -> str:
        return f"bags pooled on owner rank {servers[0]}"

    def owners(self, partitioning: RowPartitioning) -> list[int]:
        return [partitioning.server_ranks[partitioning.server_of_partition(0)]]


@dataclass(frozen=True)
class PooledByRows(Pooling):
    """Rows partitioned over the servers, each pooling its rows' share of every bag as a sum,
    which the worker adds (row-wise)."""

    name: ClassVar[str] = "pooled_by_rows"
    by_rows: ClassVar[bool] = True

    def describe(self, servers: tuple[int, ...]) -> str:
        return (f"bags pooled by rows, each server rank of {','.join(map(str, servers))} its "
                f"rows' share")

    def owners(self, partitioning: RowPartitioning) -> list[int]:
        return _servers_holding_rows(partitioning)

    def check_mode(self, name: str, rank: int, mode: str) -> None:
        if mode == "max":
            raise UnsupportedProgramError(
                f"rank {rank}: parameter '{name}' is pooled by rows (Config.pooled_by_rows), "
                f"but its nn.EmbeddingBag has mode='max': pooling by rows adds every server's "
                f"share of a bag, which gives a sum or a mean, not a max; name it in "
                f"Config.pooled_tables (pooled whole on one owner) or leave it to the row path")

    def shares(self, call: Bags, owners: list[int], refused: bool) -> dict[int, BagShare]:
        starts = call.starts
        if len(owners) == 1:
            return {owners[0]: BagShare(starts, call.ids, call.weights)}
        if refused:
            return {o: BagShare(starts[:0], call.ids[:0], None) for o in owners}
        bag = bag_of_ids(starts, call.ids.numel())
        owner = call.table.partitioning.owner_rank(call.ids)
        shares = {}
        for rank in owners:
            mine = owner == rank
            counts = torch.bincount(bag[mine], minlength=starts.numel())
            shares[rank] = BagShare(counts.cumsum(0) - counts, call.ids[mine],
                                    None if call.weights is None else call.weights[mine])
        return shares

    def owner_mode(self, mode: str, owners: int) -> str:
        # (one share of several is a sum: the worker adds them, then divides under mean)
        return "sum" if owners > 1 else mode


@dataclass(frozen=True)
class PooledByColumns(Pooling):
    """Held as ``slices`` column slices, slice k on its own server, each pooling its slice of
    every bag over the bag's whole ids in the call's mode, the worker putting the slices side
    by side (column-wise; `parallax.engine.tables.columns`; one slice on one server)."""

    name: ClassVar[str] = "pooled_by_columns"
    slices: int = 2  # type: ignore[misc]  # (a field here: the count is this value's own)

    def __post_init__(self) -> None:
        # (one slice: a single server holds the whole rows, pooled as a whole table is)
        if self.slices < 1:
            raise ArgumentError(f"a table pooled by columns is held as 1 or more slices, "
                                f"got {self.slices}")

    def describe(self, servers: tuple[int, ...]) -> str:
        return (f"bags pooled by columns: {self.slices} slices, on server ranks "
                f"{','.join(map(str, servers))}")

    def owners(self, partitioning: RowPartitioning) -> list[int]:
        if self.slices == 1:
            return [partitioning.server_ranks[partitioning.server_of_partition(0)]]
        return _servers_holding_rows(partitioning)

    def column(self, partitioning: RowPartitioning, rank: int) -> int:
        if self.slices == 1:
            return 0
        for k in range(partitioning.num_partitions):
            if partitioning.server_ranks[partitioning.server_of_partition(k)] == rank:
                return k
        raise InternalError(f"parallax internal error: rank {rank} holds no column slice; "
                            f"please report it")

    def added(self, call: Bags, shares: Tensor, owners: list[int]) -> Tensor:
        if len(owners) == 1:
            return shares
        partitioning = call.table.partitioning
        order = sorted(range(len(owners)), key=lambda i: self.column(partitioning, owners[i]))
        slices = shares.view(len(owners), call.bags, *shares.shape[1:])
        return torch.cat([slices[i] for i in order], dim=1)


@dataclass(frozen=True)
class Replicated(Sharding):
    """A replica on every worker (gradient rows gathered, or AllReduced)."""

    name: ClassVar[str] = "replicated"


@dataclass(frozen=True)
class OwnParameter(Sharding):
    """The program's own parameter, read and stepped as on one device (a world of one)."""

    name: ClassVar[str] = "own"


ROWS = RowsPulled()
POOLED = PooledWhole()
POOLED_BY_ROWS = PooledByRows()
REPLICATED = Replicated()
OWN = OwnParameter()

#: every kind by name (a new kind: its class above and its entry here)
SHARDINGS: dict[str, type[Sharding]] = {kind.name: kind for kind in (
    RowsPulled, PooledWhole, PooledByRows, PooledByColumns, Replicated, OwnParameter)}
