"""`Layout`: the tables of one run and where each parameter lives. The architecture builds it
(`parallax.planning.table_kinds.build_layout`); the plan's keeper changes it through its
methods when the warm-up moves a table to AllReduce or the partition search re-partitions one;
checkpoints and the plan read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from parallax.engine.tables.own_summed import SummedOwnTable
from parallax.engine.tables.replicated import ReplicatedTable
from parallax.engine.tables.step_context import TableSteps
from parallax.engine.tables.table import Table

__all__ = ["REPLICATED", "Layout", "Placement"]


class Placement(NamedTuple):
    """Where a parameter lives: ``sync`` (``"ps"``, ``"allgatherv"``, ``"allreduce"``), its
    partition count (0: not partitioned) and the server ranks holding it."""

    sync: str
    partitions: int
    servers: tuple[int, ...]


#: a parameter replicated and AllReduced (what a parameter without a placement is)
REPLICATED = Placement("allreduce", 0, ())


@dataclass
class Layout:
    """The tables of one run: those read by sparse lookups (``sparse``) and, when the
    architecture puts dense parameters on the servers, those pulled whole every step
    (``pulled_whole``); plus each parameter's `Placement` when it is not replicated and
    AllReduced."""

    sparse: dict[str, Table] = field(default_factory=dict)
    pulled_whole: dict[str, Table] = field(default_factory=dict)
    placements: dict[str, Placement] = field(default_factory=dict)
    #: the user's optimizer state of a server-held table, taken as its rows were scattered
    #: (this server's rows; `parallax.engine.optimizers.shard_optimizer.take_user_state`)
    #: until the servers' optimizer adopts it
    user_state: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: the step of the run's server-held tables: what their pulls owe between a step's calls
    #: (`parallax.engine.tables.step_context`), shared by every one of them
    steps: TableSteps = field(default_factory=TableSteps)
    # the replicated tables, in name order, found once (`replicas`; `add` and `replace`,
    # through which tables come and go, forget them)
    _replicas: list[ReplicatedTable] | None = field(default=None, init=False, repr=False)
    _summed_own: list[SummedOwnTable] | None = field(default=None, init=False, repr=False)

    @property
    def uses_ddp(self) -> bool:
        """Whether the dense parameters stay replicated (AllReduced by DDP)."""
        return not self.pulled_whole

    def all_tables(self) -> dict[str, Table]:
        return {**self.sparse, **self.pulled_whole}

    def placement(self, name: str) -> Placement:
        """Where parameter ``name`` lives (`REPLICATED` when no table holds it)."""
        return self.placements.get(name, REPLICATED)

    def replicas(self) -> list[ReplicatedTable]:
        """The sparse tables replicated on every worker, in name order (asked several times
        a step: found once per change of the tables)."""
        if self._replicas is None:
            self._replicas = [table for name in sorted(self.sparse)
                              if isinstance(table := self.sparse[name], ReplicatedTable)]
        return self._replicas

    def summed_own(self) -> list[SummedOwnTable]:
        """The tables replicated as the program's own parameters, their gradients summed
        over the workers (`parallax.engine.tables.own_summed`), in name order."""
        if self._summed_own is None:
            self._summed_own = [table for name in sorted(self.sparse)
                                if isinstance(table := self.sparse[name], SummedOwnTable)]
        return self._summed_own

    def add(self, table: Table) -> None:
        """``table`` holds its sparse parameter (as the architecture builds the layout)."""
        self.sparse[table.name] = table
        self._replicas = self._summed_own = None
        self.steps.groups.clear()  # (no table group may hold a table that left)

    def replace(self, new: Table) -> None:
        """``new`` holds its sparse parameter from now on (moved off the servers)."""
        self.add(new)
        self.placements[new.name] = Placement(
            "allreduce" if new.sync == "allreduce" else "allgatherv", 0, ())

    def repartitioned(self, name: str, partitions: int) -> None:
        """Parameter ``name``'s table now has ``partitions`` partitions."""
        self.placements[name] = self.placements[name]._replace(partitions=partitions)
