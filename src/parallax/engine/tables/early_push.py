"""Gradient rows pushed while the backward still runs (`Runner.step`, `Config.overlap_push`).

`Runner.step` calls the backward itself, once per forward, so a pulled table's gradient rows
are final as soon as autograd has accumulated them into the pull's leaf. `EarlyPush` then
issues their exchange at once (an async ``all_to_all`` on the sparse group) instead of after
the backward: it overlaps the rest of the backward and DDP's AllReduce of the dense
gradients. The final item is left to `push_gradients`: its message carries the step's verdict
(`parallax.engine.tables.verdict`), known only once the backward is over. A user's own loop
(`parallax.distribute`) keeps pushing in ``optimizer.step()``: it may call backward several
times per step, and a row pushed early would miss the later backwards' gradients.

Every rank must issue the same collectives in the same order. The *items* (a pull's tables,
cut into the groups of the schedule) are fixed before the backward, and launched strictly in
order, each once its rows and every earlier item's have their gradients; what the backward
leaves unlaunched (a table that got no gradient) goes out at `sync_gradients`. Timing differs
between ranks, the sequence does not. The servers add what they receive as before, one table
at a time, so training is the same to the last bit.

The schedule: tables whose gradients arrive close together travel in one message (one
``all_to_all`` rather than one per table); tables whose gradients arrive
`MIN_GAP_S` or more apart go separately, so the first can travel while the backward computes
the next. Rank 0 times the arrivals in the warm-up steps and broadcasts the groups when the
plan is completed; until then every pull is one item, pushed when all its tables are done.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch.distributed as dist
from torch import Tensor

from parallax.engine.diagnostics import phases
from parallax.engine.tables.row_exchange import can_push_early, pending_pulls, start_push
from parallax.engine.tables.server_table import ShardedTable
from parallax.engine.tables.step_context import Pull
from parallax.errors import InternalError

__all__ = ["MIN_GAP_S", "EarlyPush", "groups_from_arrivals"]

# Gradients arriving this close together share one message: a second all_to_all costs about a
# round trip (~0.3-1 ms between namespaces here), which a shorter gap could not hide.
MIN_GAP_S = 1e-3


def groups_from_arrivals(arrivals: Sequence[tuple[str, float]],
                         min_gap_s: float = MIN_GAP_S) -> list[list[str]]:
    """Table names in the order their gradients arrived (``(name, seconds)`` pairs), cut
    wherever ``min_gap_s`` or more passed between two arrivals."""
    groups: list[list[str]] = []
    last = None
    for name, at in sorted(arrivals, key=lambda pair: pair[1]):
        if last is None or at - last >= min_gap_s:
            groups.append([])
        groups[-1].append(name)
        last = at
    return groups


class EarlyPush:
    """Issues each step's gradient exchanges as the backward produces their rows."""

    def __init__(self, rank: int):
        self.rank = rank
        self.schedule: list[list[str]] | None = None  # None: one item per pull
        self.last_arrivals: list[tuple[str, float]] = []  # the last armed step's, relative
        self.launched_early = 0  # items issued before the backward ended, since construction
        self.items_total = 0
        self._items: list[tuple[Pull, list[str]]] = []
        self._next = 0
        self._ready: set[tuple[int, str]] = set()
        self._arrivals: dict[str, float] = {}
        self._start = 0.0
        self._handles: list[Any] = []

    @property
    def armed(self) -> bool:
        return bool(self._handles) or bool(self._items)

    def arm(self, tables: Sequence[ShardedTable]) -> None:
        """Before `Runner.step`'s backward: fix this step's items and watch their rows."""
        if self.armed:  # a step whose backward raised: finish it as sync_gradients would
            self.flush()
        records = pending_pulls(tables)
        self._items = self._plan(records)
        self._next = 0
        self._ready.clear()
        self._arrivals.clear()
        self._start = time.perf_counter()
        for record in records:
            for name, lookup in record.lookups.items():
                if lookup.rows.requires_grad:
                    self._handles.append(lookup.rows.register_post_accumulate_grad_hook(
                        partial(self._arrived, record, name)))

    def _plan(self, records: list[Pull]) -> list[tuple[Pull, list[str]]]:
        """The items in launch order: the last pulls first (the backward meets them first),
        each pull's units (tables, table groups) in the schedule's groups of tables (a table
        group goes with the first schedule group that holds one of its members)."""
        items: list[tuple[Pull, list[str]]] = []
        for record in reversed(records):
            if not can_push_early(record):
                continue  # through the leader hop: pushed whole at sync_gradients
            unit_of = {name: unit for unit in record.exchanged()
                       for name in record.members_of(unit)}
            placed: set[str] = set()
            groups = []
            for group in [*(self.schedule or []), list(record.lookups)]:
                units = []
                for name in group:
                    unit = unit_of.get(name)
                    if unit is not None and unit not in placed:
                        placed.add(unit)
                        units.append(unit)
                groups.append(units)
            items.extend((record, group) for group in groups if group)
        self.items_total += len(items)
        return items

    def _arrived(self, record: Pull, name: str, _rows: Tensor) -> None:
        self._arrivals[name] = time.perf_counter() - self._start
        self._ready.add((id(record), name))
        self._launch(only_ready=True)

    def _launch(self, *, only_ready: bool) -> None:
        # the final item waits for `push_gradients`: its message carries the step's verdict
        while self._next < len(self._items) - 1:
            record, units = self._items[self._next]
            if only_ready and not all((id(record), name) in self._ready for unit in units
                                      for name in record.members_of(unit)):
                return
            with phases.phase("push"):
                start_push(record, units)
            if only_ready:
                self.launched_early += 1
            self._next += 1

    def flush(self) -> None:
        """At `sync_gradients`: issue the items the backward left but the final one (which
        `push_gradients` sends with the step's verdict; collective), stop watching. A no-op
        when not armed."""
        self._launch(only_ready=False)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._items = []
        if self._arrivals:
            self.last_arrivals = sorted(self._arrivals.items(), key=lambda pair: pair[1])

    def learn(self, group: dist.ProcessGroup) -> list[list[str]]:
        """Set the schedule from rank 0's last armed step (collective, once: at the plan)."""
        message = [groups_from_arrivals(self.last_arrivals) if self.rank == 0 else None]
        dist.broadcast_object_list(message, src=0, group=group)
        schedule = message[0]
        if schedule is None:
            raise InternalError("rank 0 sent no push schedule; please report it")
        self.schedule = schedule
        return schedule
