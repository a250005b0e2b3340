"""The partition-count search run inside training: no relaunch, no wasted steps.

After the sparsity warm-up, the tuner takes the partition groups one after another (tables of
one `parallax.partitioner` share a count). For each it follows `partition_search.sampling`: every
sample re-partitions the group's tables in process (values and optimizer state kept, so training
is unchanged) and times the next ``Config.partition_search_steps`` user steps, the first half
discarded. Every rank times its own steps; the slowest rank's mean is the sample, so all ranks
take the same decisions. The chosen count, the samples and the fit are printed on rank 0, shown
by the plan and stored in the `partition_cache`, where the next run of the same job finds them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from parallax.cluster import WorkerInfo
from parallax.collective import agree
from parallax.config import Config
from parallax.engine.tables.table import Table
from parallax.logs import log
from parallax.partitions.cache import cache_key, load_entry, store_entry
from parallax.partitions.groups import group_of
from parallax.partitions.search import Sample, SearchResult, sampling, second_half_mean

__all__ = ["PartitionTuner", "SearchRecord", "build_tuner", "slowest_rank_mean"]

DEFAULT_MAX_PER_SERVER = 64


@dataclass(frozen=True)
class SearchRecord:
    """How one group's partition count was chosen: ``source`` is ``"searched"`` (this run) or
    ``"cache"`` (an earlier run's search, whose samples and fit are repeated here)."""

    group: str
    tables: tuple[str, ...]
    partitions: int
    samples: tuple[Sample, ...]
    theta: tuple[float, float, float] | None
    source: str
    search_seconds: float = 0.0

    def summary(self) -> str:
        samples = ", ".join(f"P={s.partitions}: {s.seconds * 1e3:.1f} ms"
                            for s in self.samples)
        fit = ("" if self.theta is None else
               " ; fit t(P) = {:.4g} + {:.4g}/P + {:.4g}*P s".format(*self.theta))
        origin = (f"searched in {self.search_seconds:.1f} s"
                  if self.source == "searched" else "from the partition cache")
        return (f"partition group '{self.group}' ({', '.join(self.tables)}): P={self.partitions}"
                f", {origin} ; samples {samples}{fit}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Group:
    name: str
    tables: list[str]
    max_partitions: int


def slowest_rank_mean(durations: list[float], group: dist.ProcessGroup | None,
                      device: torch.device) -> float:
    """A timed sample: the mean of the second half of ``durations`` on the slowest rank
    (collective over ``group``; None: this process alone), so every rank decides alike."""
    measured = torch.tensor(second_half_mean(durations), dtype=torch.float64, device=device)
    if group is not None:
        dist.all_reduce(measured, op=dist.ReduceOp.MAX, group=group)
    return float(measured)


class PartitionTuner:
    """Drives the search from `Runner.step`: `begin` once the plan is complete, then
    `after_step` with every step's duration until `active` turns False (collective)."""

    def __init__(self, groups: dict[str, tuple[list[str], int]], *,
                 repartition: Callable[[int, list[str]], None], start: int,
                 steps_per_sample: int, cache_path: str | None, signature: dict[str, Any],
                 rank: int, group: dist.ProcessGroup, device: torch.device):
        """``groups`` maps a group name to its server-held tables and its largest count."""
        self._groups = [_Group(name, tables, cap) for name, (tables, cap) in groups.items()]
        self._repartition = repartition
        self._start = start
        self._steps_per_sample = steps_per_sample
        self._cache_path = cache_path
        self._signature = signature
        self._rank = rank
        self._process_group = group
        self._device = device
        self.records: dict[str, SearchRecord] = {}
        self.active = False
        self._current: _Group | None = None
        self._search: Generator[int, float, SearchResult] | None = None
        self._partitions = 0
        self._durations: list[float] = []
        self._began = 0.0

    def groups_on_servers(self, names: set[str]) -> None:
        """Forget tables that left the servers (moved to AllReduce after the warm-up), and
        groups left without tables."""
        for group in self._groups:
            group.tables = [name for name in group.tables if name in names]
        self._groups = [group for group in self._groups if group.tables]

    def begin(self, batch_signature: Any) -> None:
        """Take counts found earlier from the cache; start searching the other groups."""
        self._signature = {**self._signature, "batch": batch_signature}
        self._queue = []
        for group in self._groups:
            entry = self._cached(group)
            if entry is None:
                self._queue.append(group)
                continue
            self._repartition(entry["partitions"], group.tables)
            self.records[group.name] = SearchRecord(
                group.name, tuple(group.tables), entry["partitions"],
                tuple(Sample(int(p), float(s)) for p, s in entry.get("samples", [])),
                tuple(entry["theta"]) if entry.get("theta") else None, "cache")
            self._say(self.records[group.name].summary())
        self._next_group()

    def after_step(self, seconds: float) -> None:
        if not self.active:
            return
        self._durations.append(seconds)
        if len(self._durations) < self._steps_per_sample:
            return
        measured = slowest_rank_mean(self._durations, self._process_group, self._device)
        assert self._current is not None and self._search is not None
        self._say(f"partition search '{self._current.name}': P={self._partitions} "
                  f"{measured * 1e3:.1f} ms/step")
        try:
            self._switch(self._search.send(measured))
        except StopIteration as done:
            self._finish(done.value)

    # ---- internals ---------------------------------------------------------------------------
    def _cache_signature(self, group: _Group) -> dict[str, Any]:
        return {**self._signature, "group": group.name, "searched_tables": group.tables,
                "max_partitions": group.max_partitions}

    def _cached(self, group: _Group) -> dict[str, Any] | None:
        entry = None
        if self._rank == 0 and self._cache_path is not None:
            entry = load_entry(self._cache_path, cache_key(self._cache_signature(group)))
        return agree(entry, rank=self._rank, group=self._process_group)

    def _next_group(self) -> None:
        if not self._queue:
            self.active = False
            self._current = self._search = None
            return
        self._current = self._queue.pop(0)
        self.active = True
        self._began = time.perf_counter()
        start = min(self._start, self._current.max_partitions)
        self._search = sampling(start, max_partitions=self._current.max_partitions,
                                balance=self._start)
        self._switch(next(self._search))

    def _switch(self, partitions: int) -> None:
        assert self._current is not None
        self._repartition(partitions, self._current.tables)
        self._partitions = partitions
        self._durations = []

    def _finish(self, result: SearchResult) -> None:
        group = self._current
        assert group is not None
        self._repartition(result.partitions, group.tables)
        record = SearchRecord(group.name, tuple(group.tables), result.partitions,
                              result.samples, result.theta, "searched",
                              time.perf_counter() - self._began)
        self.records[group.name] = record
        self._say(record.summary())
        if self._rank == 0 and self._cache_path is not None:
            store_entry(self._cache_path, cache_key(self._cache_signature(group)), {
                "partitions": result.partitions,
                "samples": [[s.partitions, s.seconds] for s in result.samples],
                "theta": list(result.theta) if result.theta else None,
                "signature": self._cache_signature(group),
                "searched_at": datetime.now(UTC).isoformat(timespec="seconds"),
            })
        self._next_group()

    def _say(self, message: str) -> None:
        log.info("parallax: %s", message)  # rank 0's, by default (`parallax.logs`)


def build_tuner(model: nn.Module, tables: dict[str, Table], *, config: Config,
                worker: WorkerInfo, local_aggregation: bool, threads: int,
                group: dist.ProcessGroup, device: torch.device,
                repartition: Callable[[int, list[str]], None]) -> PartitionTuner | None:
    """A tuner for the server-held tables created in a `parallax.partitioner` (None when there
    are none; the same on every rank: checked at start-up). Its cache entries are valid for
    this model, cluster shape and the settings that change a step's time."""
    params = dict(model.named_parameters())
    groups: dict[str, tuple[list[str], int]] = {}
    servers = len(worker.server_ranks)
    for name, table in sorted(tables.items()):
        partition_group = group_of(params[name])
        if partition_group is None or not table.on_servers:
            continue
        cap = partition_group.max_partitions or config.max_partitions or (
            DEFAULT_MAX_PER_SERVER * servers)
        names, previous = groups.get(partition_group.name, ([], cap))
        groups[partition_group.name] = ([*names, name],
                                        max(1, min(previous, cap, table.num_rows)))
    if not groups:
        return None
    signature = {
        "parameters": [[n, list(p.shape), str(p.dtype)] for n, p in params.items()],
        "architecture": str(config.architecture),
        "local_aggregation": local_aggregation,
        "lazy_sparse_updates": config.lazy_sparse_updates,
        "server_threads": threads,
        "machines": servers, "world_size": worker.world_size,
        "device": device.type,
    }
    return PartitionTuner(
        groups, repartition=repartition, start=servers,
        steps_per_sample=config.partition_search_steps, cache_path=config.partition_cache,
        signature=signature, rank=worker.rank, group=group, device=device)
