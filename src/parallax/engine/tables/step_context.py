"""What one step of the server-held tables pulled and still owes, kept apart from the tables.

A step's exchange leaves state between its calls: the forward's pulls, whose gradient rows the
push sends back; the rows pulled ahead of the forward for its lookups; the bags pooled on their
owners, ahead or owed. None of it belongs to a table (a table is its rows and their gradient),
so none of it lives on one: the tables of a run share one `TableSteps`, whose `current`
`StepContext` holds it. A context is made when the previous one ends, that is when a push has
sent every gradient row owed (`TableSteps.pushed`), and is then dropped whole: nothing of a
step outlives it. A forward's reads (`Prefetched`, pooled ahead) are dropped when the forward
ends.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

from parallax.engine.tables.exchange import Hop
from parallax.errors import InternalError

__all__ = ["Lookup", "OwedRows", "Prefetched", "Pull", "StepContext", "Stepped", "TableSteps",
           "shared_steps", "version_of"]


@dataclass
class Lookup:
    """One table's part of a `Pull`."""

    ids: Tensor                 # this worker's unique ids
    rows: Tensor                # leaf [unique ids, *row]; its .grad is what gets pushed
    # permutation sorting the (merged) ids by owner rank; None: already sorted (one owner)
    order: Tensor | None
    recv_local_rows: Tensor     # on a server: the shard rows the received ids address
    # those rows are sorted and distinct (one sender's unique ids, one partition here)
    local_sorted: bool = False
    merged_inverse: Tensor | None = None  # at a leader: received piece -> merged row
    merged_count: int = 0
    counts: Tensor | None = None  # scale_grad_by_freq: how often the batch looked up each id


@dataclass
class Pull:
    """Rows of several tables pulled in one exchange; their gradients go back the same way
    (in one exchange, or, pushed early, in one per group of tables:
    `parallax.engine.tables.row_exchange.start_push`)."""

    lookups: dict[str, Lookup]
    direct: Hop                   # worker -> owners (leader -> owners when aggregating)
    to_leader: Hop | None = None  # worker -> its machine's leader (local aggregation)
    # pushed early: the exchanges issued (each returns what its owners received) and their
    # tables; the push waits for them
    in_flight: list[Callable[[], dict[str, Tensor]]] = field(default_factory=list)
    launched: list[str] = field(default_factory=list)  # the units pushed early
    #: where tables travelled as a table group (`parallax.engine.tables.table_group`): per
    #: unit of the exchange (a group, or a table alone) the lookup of what it exchanged;
    #: empty when every table travelled alone (its unit's lookup is then its own)
    units: dict[str, Lookup] = field(default_factory=dict)
    groups: dict[str, Any] = field(default_factory=dict)  # per group's unit, the group

    def exchanged(self) -> dict[str, Lookup]:
        """Per unit of the exchange, in message order, the lookup of what it exchanged."""
        return self.units or self.lookups

    def members_of(self, unit: str) -> list[str]:
        """The tables of ``unit`` (itself, unless it is a group)."""
        group = self.groups.get(unit)
        return [unit] if group is None else group.member_names


@dataclass
class Prefetched:
    """A table's rows pulled ahead of the forward, for all of the step's lookups at once."""

    ids: Tensor   # sorted unique ids
    rows: Tensor  # the pull's leaf rows
    # per lookup read ahead: its ids tensor, that tensor's version then (None: an inference
    # tensor, which keeps none), and the index of each of its ids among ``ids`` (the pull's
    # inverse)
    lookups: list[tuple[Tensor, int | None, Tensor]] = field(default_factory=list)

    def inverse_of(self, ids: Tensor) -> Tensor | None:
        """The index of each of ``ids`` among the pulled rows when ``ids`` is the very tensor
        a lookup was read ahead from, or a view of the same memory laid out alike (the
        forward's own ``x[:, 0]`` beside the look-ahead's), unchanged since (no in-place
        write: views share their base's version); None otherwise (the lookup then finds its
        ids among the pulled ones)."""
        for known, version, inverse in self.lookups:
            if (version is not None and _same_memory(known, ids)
                    and version == version_of(ids)):
                return inverse.view(ids.shape)
        return None


def _same_memory(known: Tensor, ids: Tensor) -> bool:
    """Whether ``ids`` reads the very elements ``known`` reads, as ``known`` reads them
    (``known`` is kept alive, so its storage cannot be another tensor's since)."""
    return known is ids or (
        known.numel() > 0 and ids.layout == known.layout == torch.strided
        and known.dtype == ids.dtype and known.device == ids.device
        and known.shape == ids.shape and known.stride() == ids.stride()
        and known.storage_offset() == ids.storage_offset()
        and known.untyped_storage().data_ptr() == ids.untyped_storage().data_ptr())


class OwedRows(NamedTuple):
    """A lookup of a table that exchanges its rows itself (replicated, asynchronous), whose
    gradient is owed: its unique ids, the leaf rows looked up (their ``.grad`` is what goes)
    and, under ``scale_grad_by_freq``, how often the batch looked up each id."""

    ids: Tensor
    rows: Tensor
    counts: Tensor | None = None


def version_of(ids: Tensor) -> int | None:
    """``ids``' version counter (bumped by every in-place write), None for an inference
    tensor (made under ``torch.inference_mode``), which has none: such ids are searched."""
    return None if ids.is_inference() else ids._version


class StepContext:
    """What one step of a run's server-held tables pulled and owes (see the module)."""

    def __init__(self) -> None:
        #: the pulls whose gradient rows are owed, in pull order: the order the push takes
        #: them, the same on every rank
        self.pulls: list[Pull] = []
        #: the pooled exchanges whose gradients are owed, in call order
        #: (`parallax.engine.tables.pooled.PooledExchange`: that module reads this one)
        self.pooled: list[Any] = []
        #: per table, the rows pulled ahead of this forward (until it ends)
        self.prefetched: dict[str, Prefetched] = {}
        #: per table, the bags pooled ahead of this forward, in call order (until it ends):
        #: (`parallax.engine.tables.pooled.BagCall`, its pooled rows)
        self.pooled_ahead: dict[str, list[tuple[Any, Tensor]]] = {}
        #: per table that exchanges its rows itself, its lookups owed, in lookup order
        self.owed: dict[str, list[OwedRows]] = {}
        #: the replicated tables whose owed rows the own loop summed at each backward's end
        #: (`parallax.engine.tables.backward_push`): the step's push sends nothing more
        self.summed_after_backward: set[str] = set()


class TableSteps:
    """The current step of a run's server-held tables (one per run, shared by its tables).

    Also counts each table's lookups with gradients since its last ``zero_grad``
    (``scale_grad_by_freq`` allows one): a count that spans steps, as the gradient does."""

    def __init__(self) -> None:
        self.current = StepContext()
        self.lookups: dict[str, int] = {}
        #: the units of the last pull's set of tables: the table groups that live as long
        #: as their members stay alike (`parallax.engine.tables.table_group.groups_of`)
        self.groups: dict[Any, list[Any]] = {}
        #: per table, its item in the early push's schedule (`parallax.engine.tables.
        #: early_push`): tables of different items are never grouped, so that the first can
        #: leave while the backward computes the next
        self.push_items: dict[str, int] = {}

    def schedule_pushes(self, schedule: Sequence[Sequence[str]]) -> None:
        """The early push's ``schedule`` (the same on every rank) holds from the next pull."""
        items = {name: k for k, item in enumerate(schedule) for name in item}
        if items != self.push_items:
            self.push_items = items
            self.groups.clear()

    def pushed(self, pulls: Sequence[Pull], exchanges: Sequence[Any]) -> None:
        """``pulls`` and ``exchanges`` have sent their gradient rows: they are owed no more;
        once nothing is, the step's context ends and the next step's begins (a forward still
        running keeps what it read ahead)."""
        step = self.current
        # (``pulls`` is a part of those owed, so as many is all of them: the usual step)
        if pulls:
            step.pulls = [] if len(pulls) == len(step.pulls) else _without(step.pulls, pulls)
        if exchanges:
            step.pooled = ([] if len(exchanges) == len(step.pooled)
                           else _without(step.pooled, exchanges))
        self._end_if_done()

    def count_lookup(self, name: str) -> int:
        """One more lookup with gradients of table ``name``: how many since its zero_grad."""
        self.lookups[name] = count = self.lookups.get(name, 0) + 1
        return count

    def forget_lookups(self, name: str) -> None:
        """Table ``name``'s gradient was cleared: its lookups count from none again."""
        if name in self.lookups:  # (no call beyond this one: every step clears every table)
            del self.lookups[name]

    def owe(self, name: str, lookup: OwedRows) -> None:
        """Table ``name`` (one that exchanges its rows itself) owes ``lookup``'s gradient."""
        self.current.owed.setdefault(name, []).append(lookup)

    def owed(self, name: str) -> list[OwedRows]:
        """Table ``name``'s lookups owed this step, in lookup order (kept owed)."""
        return self.current.owed.get(name, [])

    def take_owed(self, name: str) -> list[OwedRows]:
        """Table ``name``'s lookups owed this step, now pushed: owed no more."""
        step = self.current
        taken = step.owed.pop(name, [])
        step.summed_after_backward.discard(name)
        self._end_if_done()
        return taken

    def _end_if_done(self) -> None:
        """Once nothing is owed and no forward reads ahead, the step's context ends."""
        step = self.current
        if not (step.pulls or step.pooled or step.prefetched or step.pooled_ahead or step.owed
                or step.summed_after_backward):
            self.current = StepContext()

    def forward_done(self, names: Sequence[str]) -> None:
        """A forward has ended: what it read ahead for tables ``names`` is dropped (the next
        forward reads its own)."""
        step = self.current
        for name in names:
            if name in step.prefetched:
                del step.prefetched[name]
            if name in step.pooled_ahead:
                del step.pooled_ahead[name]


def _without(owed: list[Any], sent: Sequence[Any]) -> list[Any]:
    """``owed`` but for the very objects ``sent``, in order."""
    gone = {id(item) for item in sent}
    return [item for item in owed if id(item) not in gone]


class Stepped(Protocol):
    """A table whose step lives in a `TableSteps`."""

    steps: TableSteps


def shared_steps(tables: Sequence[Stepped]) -> TableSteps:
    """The `TableSteps` every table of one exchange shares: tables of one run share one
    (the layout's); anything else is a bug of ours."""
    steps = tables[0].steps
    for table in tables:
        if table.steps is not steps:
            raise InternalError("parallax internal error: tables of one exchange belong to "
                                "different runs' steps; please report it")
    return steps
