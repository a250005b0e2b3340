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
class here and one entry in `SHARDINGS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from parallax.errors import ArgumentError

__all__ = ["OWN", "POOLED", "POOLED_BY_ROWS", "REPLICATED", "ROWS", "SHARDINGS",
           "OwnParameter", "PooledByColumns", "PooledByRows", "PooledWhole", "Replicated",
           "RowsPulled", "Sharding"]


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


@dataclass(frozen=True)
class RowsPulled(Sharding):
    """Rows partitioned over the servers, pulled by the workers each step."""

    name: ClassVar[str] = "rows"

    def describe(self, servers: tuple[int, ...]) -> str:
        return "rows pulled"


@dataclass(frozen=True)
class PooledWhole(Sharding):
    """Held whole on one server, which pools every bag (TorchRec's table-wise)."""

    name: ClassVar[str] = "pooled"
    pools: ClassVar[bool] = True

    def describe(self, servers: tuple[int, ...]) -> str:
        return f"bags pooled on owner rank {servers[0]}"


@dataclass(frozen=True)
class PooledByRows(Sharding):
    """Rows partitioned over the servers, each pooling its rows' share (row-wise)."""

    name: ClassVar[str] = "pooled_by_rows"
    pools: ClassVar[bool] = True
    by_rows: ClassVar[bool] = True

    def describe(self, servers: tuple[int, ...]) -> str:
        return (f"bags pooled by rows, each server rank of {','.join(map(str, servers))} its "
                f"rows' share")


@dataclass(frozen=True)
class PooledByColumns(Sharding):
    """Held as ``slices`` column slices, slice k on its own server, each pooling its slice of
    every bag (column-wise; `parallax.engine.tables.columns`; one slice on one server)."""

    name: ClassVar[str] = "pooled_by_columns"
    pools: ClassVar[bool] = True
    slices: int = 2  # type: ignore[misc]  # (a field here: the count is this value's own)

    def __post_init__(self) -> None:
        # (one slice: a single server holds the whole rows, pooled as a whole table is)
        if self.slices < 1:
            raise ArgumentError(f"a table pooled by columns is held as 1 or more slices, "
                                f"got {self.slices}")

    def describe(self, servers: tuple[int, ...]) -> str:
        return (f"bags pooled by columns: {self.slices} slices, on server ranks "
                f"{','.join(map(str, servers))}")


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
