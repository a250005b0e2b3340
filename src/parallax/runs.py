"""A training run of this process, and what belongs to it.

A process may train many times (a sweep, a notebook cell run again, pretraining then
fine-tuning, a test harness), in the same process groups. What one run creates must not reach
the next: `TrainingRun` holds the run's runners, the `parallax.shard` loaders that fed it (a
checkpoint saves exactly these), the loader positions a resume holds for loaders the program
has not made yet, and the data-parallel grid its loaders read under model parallelism.

When a run begins: a runner (``parallax.distribute``, ``parallax.get_runner``) joins the
current run while that run has not stepped (two models of one program, built before the loop),
and begins a new one otherwise. A loader belongs to the run that is current when it starts an
iteration (a loader made before ``distribute`` belongs to the run that ``distribute`` begins);
one made while no run exists waits, unbound, for the next run; one iterated again under a later
run moves to it (pretraining's loader reused to fine-tune).

Only `current_run` and the loaders not yet bound are process-wide: everything else lives on
the `TrainingRun`, and `end_run` (``parallax.shutdown``) forgets the current one.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["TrainingRun", "bind", "current_run", "end_run", "join_run", "unbound_loaders"]


class Loader(Protocol):
    """What a run holds of a loader (`parallax.loader.ShardedLoader`): the run it is in."""

    run: TrainingRun | None


@dataclass
class TrainingRun:
    """One training run: its runners, its loaders (in the order they joined it), the loader
    records a resume holds for loaders not made yet, and its data-parallel grid."""

    number: int
    stepped: bool = False
    data_parallel: tuple[int, int, int] | None = None
    waiting: list[dict[str, Any]] = field(default_factory=list)
    said: set[str] = field(default_factory=set)  # notes said once per run (parallax.shard's)
    resumed: list[dict[str, Any]] = field(default_factory=list)  # a resume's loader records
    taken: int = 0  # of those, the ones a loader of the run took
    _runners: list[weakref.ref[Any]] = field(default_factory=list)
    _loaders: list[weakref.ref[Loader]] = field(default_factory=list)

    def runners(self) -> list[Any]:
        """The run's live runners, oldest first."""
        self._runners[:] = [ref for ref in self._runners if ref() is not None]
        return [runner for ref in self._runners if (runner := ref()) is not None]

    def loaders(self) -> list[Loader]:
        """The run's live loaders, in the order they joined it (weakly held: a loader the
        program dropped is not saved)."""
        self._loaders[:] = [ref for ref in self._loaders if ref() is not None]
        return [loader for ref in self._loaders if (loader := ref()) is not None]

    def add_runner(self, runner: Any) -> None:
        self._runners.append(weakref.ref(runner))

    def add_loader(self, loader: Loader) -> None:
        if all(ref() is not loader for ref in self._loaders):
            self._loaders.append(weakref.ref(loader))

    def remove_loader(self, loader: Loader) -> None:
        self._loaders[:] = [ref for ref in self._loaders if ref() is not loader]


class _Process:
    """The process-wide part: which run is current, and the loaders no run holds yet."""

    def __init__(self) -> None:
        self.current: TrainingRun | None = None
        self.count = 0
        self.unbound: list[weakref.ref[Loader]] = []


_process = _Process()


def current_run() -> TrainingRun | None:
    """The run the next loader iteration belongs to (None before the first runner, and after
    ``parallax.shutdown``)."""
    return _process.current


def join_run(runner: Any) -> TrainingRun:
    """The run ``runner`` belongs to: the current one while it has not stepped and has a live
    runner, else a new one."""
    run = _process.current
    if run is None or run.stepped or not run.runners():
        _process.count += 1
        run = TrainingRun(_process.count)
        _process.current = run
    run.add_runner(runner)
    return run


def end_run() -> None:
    """No run is current any more (``parallax.shutdown``): the next runner begins a new one
    and the loaders of this one stay with it."""
    _process.current = None


def unbound_loaders() -> list[Loader]:
    """Live loaders no run holds yet, in the order they were made."""
    _process.unbound[:] = [ref for ref in _process.unbound if ref() is not None]
    return [loader for ref in _process.unbound if (loader := ref()) is not None]


def hold_unbound(loader: Loader) -> None:
    """``loader`` was made while no run could take it."""
    _process.unbound.append(weakref.ref(loader))


def bind(loader: Loader, run: TrainingRun) -> None:
    """``loader`` belongs to ``run`` from now on (taken from the unbound ones or from the run
    it belonged to)."""
    _process.unbound[:] = [ref for ref in _process.unbound if ref() is not loader]
    previous = loader.run
    if previous is not None and previous is not run:
        previous.remove_loader(loader)
    loader.run = run
    run.add_loader(loader)
