"""`AsyncTraining`: what a runner holds under `Config.sync` ``"async"`` / ``"async-sparse"``.

It wraps the layout's server-held tables in `AsyncTable`s, runs this process's server thread
(`parallax.engine.asynchronous.async_server`), moves pulls and pushes by point-to-point messages,
and keeps the staleness bound (`StalenessGate`). Per step on a worker: `before_step` (wait while
more than ``max_staleness`` steps ahead of the slowest worker) -> pulls in the forward -> backward
-> `push` (every server acknowledges once the push is applied) -> `after_step` (this worker's
clock). Checkpoints, export and whole-table reads run `quiet`: a barrier after which every
push is applied and no request is in flight, so the shards form one consistent snapshot.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch._C._distributed_c10d import PrefixStore, Store
from torch.distributed import distributed_c10d

from parallax.cluster import WorkerInfo
from parallax.engine.asynchronous.async_server import (
    _GRADS,
    _HEADER,
    _IDS,
    _REPLY,
    PULL,
    PUSH,
    SKIP,
    STOP,
    AsyncChannel,
    AsyncServerError,
    ServerState,
    ServerThread,
)
from parallax.engine.asynchronous.async_table import AsyncTable
from parallax.engine.diagnostics import failing, phases
from parallax.engine.optimizers.shard_optimizer import ShardOptimizer
from parallax.engine.tables.exchange import Traffic
from parallax.engine.tables.server_table import ShardedTable
from parallax.errors import InternalError

__all__ = ["AsyncTraining", "StalenessGate"]

log = logging.getLogger("parallax")
_serial = itertools.count()  # runners of this process: the same sequence on every rank


class StalenessGate:
    """Per-worker step clocks in the job's store; `wait` keeps a worker at most ``bound``
    steps ahead of the slowest (``None``: no bound)."""

    def __init__(self, rank: int, world_size: int, bound: int | None, timeout_s: float,
                 store: Store | None = None, check: Callable[[], None] | None = None):
        self.rank = rank
        # called each poll: a failure this process already knows of (its server thread died)
        # ends the wait at once instead of after the timeout
        self.check = check
        self.world_size = world_size
        self.bound = bound
        self.timeout_s = timeout_s
        base = store if store is not None else distributed_c10d._get_default_store()
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.store = PrefixStore(f"parallax/async/{restart}/{next(_serial)}", base)
        self.waited_s = 0.0
        self.lags: list[int] = []  # per bounded step: how far ahead of the slowest it began

    def start(self, step: int) -> None:
        """This worker has finished ``step`` steps (at start, or after loading a checkpoint)."""
        self.store.set(f"clock{self.rank}", str(step))

    def finished(self) -> None:
        self.store.add(f"clock{self.rank}", 1)

    def close(self) -> None:
        """This worker trains no more: it holds nobody back."""
        with contextlib.suppress(Exception):  # at exit the launcher's store may be gone
            self.store.set(f"finished{self.rank}", "1")

    def clocks(self) -> dict[int, int]:
        """Every worker's finished steps."""
        return {r: self.store.add(f"clock{r}", 0) for r in range(self.world_size)}

    def wait(self, step: int) -> None:
        """Before ``step``: wait until every worker finished step ``step - 1 - bound``."""
        if self.bound is None or self.world_size == 1:
            return
        need = step - 1 - self.bound
        began = time.monotonic()
        pause = 0.0002
        while True:
            clocks = {r: self.store.add(f"clock{r}", 0) for r in range(self.world_size)
                      if r != self.rank}
            slowest = min(clocks, key=clocks.__getitem__)
            if clocks[slowest] < need and self.store.check([f"finished{slowest}"]):
                clocks = {r: c for r, c in clocks.items()  # a finished worker waits nobody
                          if not self.store.check([f"finished{r}"])} or {slowest: need}
                slowest = min(clocks, key=clocks.__getitem__)
            if clocks[slowest] >= need:
                self.lags.append(step - 1 - min(clocks[slowest], step - 1))
                self.waited_s += time.monotonic() - began
                return
            if time.monotonic() - began > self.timeout_s:
                raise AsyncServerError(
                    f"rank {self.rank} waited {self.timeout_s:g} s (Config.collective_timeout_s) "
                    f"before step {step}: with max_staleness={self.bound} it needs every worker "
                    f"to have finished step {need}, but rank {slowest} finished "
                    f"{clocks[slowest]} (it stopped, crashed or hangs)")
            if self.check is not None:
                self.check()
            time.sleep(pause)
            pause = min(pause * 2, 0.005)


class AsyncTraining:
    """See the module. Collective to build (every rank, in the same order)."""

    def __init__(self, tables: dict[str, ShardedTable], *, worker: WorkerInfo,
                 max_staleness: int | None, timeout_s: float, traffic: Traffic):
        self.rank = worker.rank
        self.world_size = worker.world_size
        self.server_ranks = worker.server_ranks
        self.timeout_s = timeout_s
        self.traffic = traffic
        self.inner = list(tables.values())
        self.channel = AsyncChannel(self.inner, rank=self.rank, timeout_s=timeout_s)
        self.state = (ServerState(self.inner, world_size=self.world_size,
                                  aggregate=max_staleness == 0, rank=self.rank,
                                  timeout_s=timeout_s)
                      if worker.is_server else None)
        self.thread = (ServerThread(self.channel, self.state, self.world_size)
                       if self.state is not None and self.world_size > 1 else None)
        self.tables = {name: AsyncTable(table, i, self)
                       for i, (name, table) in enumerate(tables.items())}
        self.gate = StalenessGate(self.rank, self.world_size, max_staleness, timeout_s,
                                  check=self.check)
        self.step = 0
        self.skip_push = False  # Config.nonfinite="skip" found this worker's gradient bad
        self._quiet_depth = 0
        self.closed = False
        # a failing worker must not keep serving the others until they finish (its launcher
        # would not see the failure, nor restart the job, until then)
        failing.watch()

    def start(self, shard_optimizer: ShardOptimizer, step: int) -> None:
        """Serve: the servers' optimizer is built and the initial values are in place."""
        if self.state is not None:
            self.state.optimizer = shard_optimizer
        self.gate.start(step)
        if self.thread is not None:
            self.thread.start()

    def _own_state(self) -> ServerState:
        """This process's server state (only a server serves its own rows)."""
        if self.state is None:
            raise InternalError(f"rank {self.rank} is no server; please report it")
        return self.state

    # ---- per step ----------------------------------------------------------------------
    def before_step(self, step: int) -> None:
        self.check()
        self.step = step
        self.gate.wait(step)

    def after_step(self) -> None:
        self.gate.finished()

    def global_steps(self) -> int:
        """Steps finished by all workers together (asynchronous training's global step: a
        loop that should end after a total amount of work, whichever workers did it, reads
        this)."""
        return sum(self.gate.clocks().values())

    def check(self) -> None:
        """Raise what this process's server thread failed with, if it did."""
        if self.thread is not None and self.thread.error is not None:
            raise AsyncServerError(
                f"rank {self.rank}: its parameter-server thread failed: {self.thread.error}"
            ) from self.thread.error

    def pull(self, indices: Sequence[int], tables: Sequence[ShardedTable],
             uniques: Sequence[Tensor]) -> list[Tensor]:
        """Rows of ``uniques[k]`` (sorted unique ids) of ``tables[k]`` (message index
        ``indices[k]``): one request to each server that owns any of them."""
        with phases.phase("pull"):
            return self._pull(indices, tables, uniques)

    def _pull(self, indices: Sequence[int], tables: Sequence[ShardedTable],
              uniques: Sequence[Tensor]) -> list[Tensor]:
        self.check()
        out = [torch.empty((u.numel(), *t.row_shape), dtype=t.dtype)
               for t, u in zip(tables, uniques, strict=True)]
        by_server = self._by_server(indices, tables, uniques)
        sends, remote = [], []
        for server, items in by_server.items():
            counts, ids = self._counts(items, indices)
            if server == self.rank:
                pulled = self._own_state().pull(counts, ids)
                for (k, where, _), rows in zip(items, pulled, strict=True):
                    out[k][where] = rows
            else:
                sends += self._send(server, PULL, counts, ids)
                remote.append((server, items))
        for server, items in remote:
            for k, where, _ in items:
                rows = self.channel.recv(self.channel.rows(indices[k], where.numel()), server,
                                         _REPLY, f"rows of '{tables[k].name}'")
                out[k][where] = rows
                self._count(tables[k], server, where.numel(), received=True)
        for work in sends:
            work.wait(self.channel.timeout)
        return out

    def push(self, tables: Sequence[AsyncTable]) -> None:
        """This step's gradient rows of ``tables`` to every server (one push each, empty where
        it owns none of them); returns once every server applied it."""
        self.check()
        skip, self.skip_push = self.skip_push, False
        taken = [table.gradient_rows() for table in tables]
        inner = [table.inner for table in tables]
        indices = [table.index for table in tables]
        by_server = self._by_server(indices, inner, [ids for ids, _ in taken])
        sends, remote = [], []
        acknowledged = True
        for server in self.server_ranks:
            items = [] if skip else by_server.get(server, [])
            counts, ids = self._counts(items, indices)
            grads = [taken[k][1][where] for k, where, _ in items]
            if server == self.rank:
                done = self._own_state().push(self.rank, self.step, counts, ids, grads, skip=skip)
                # in flight, not waited here: the others may first wait for another
                # server's reply (see ServerThread.in_flight)
                sends += [self.channel.send(torch.ones(1), rank, _REPLY)
                          for rank in done if rank != self.rank]
                acknowledged = self.rank in done
            else:
                sends += self._send(server, SKIP if skip else PUSH, counts, ids, grads)
                remote.append(server)
                for k, where, _ in items:
                    self._count(inner[k], server, where.numel(), received=False)
        for server in remote:
            self.channel.recv(torch.empty(1), server, _REPLY,
                              f"acknowledgement of step {self.step}'s push")
        if not acknowledged:
            self._own_state().wait_applied(self.step, check=self.check)
        for work in sends:
            work.wait(self.channel.timeout)

    def _by_server(self, indices: Sequence[int], tables: Sequence[ShardedTable],
                   uniques: Sequence[Tensor]) -> dict[int, list[tuple[int, Tensor, Tensor]]]:
        """Per owning server: ``(k, positions, ids)`` of each request that has rows there,
        in message order (by table index)."""
        by_server: dict[int, list[tuple[int, Tensor, Tensor]]] = {}
        order = sorted(range(len(tables)), key=lambda k: indices[k])
        for k in order:
            owner = tables[k].partitioning.owner_rank(uniques[k])
            for server in self.server_ranks:
                where = (owner == server).nonzero().flatten()
                if where.numel():
                    by_server.setdefault(server, []).append((k, where, uniques[k][where]))
        return by_server

    def _counts(self, items: Sequence[tuple[int, Tensor, Tensor]],
                indices: Sequence[int]) -> tuple[list[int], Tensor]:
        counts = [0] * len(self.inner)
        for k, _, ids in items:
            counts[indices[k]] = ids.numel()
        ids = (torch.cat([ids for _, _, ids in items]) if items
               else torch.empty(0, dtype=torch.long))
        return counts, ids

    def _send(self, server: int, kind: int, counts: list[int], ids: Tensor,
              grads: Sequence[Tensor] = ()) -> list[dist.Work]:
        channel = self.channel
        works = [channel.send(channel.header(kind, self.step, counts), server, _HEADER)]
        if ids.numel():
            works.append(channel.send(ids, server, _IDS))
        works += [channel.send(g, server, _GRADS) for g in grads]
        return works

    def _count(self, table: ShardedTable, server: int, rows: int, *, received: bool) -> None:
        """Bytes of one table's rows to or from ``server`` in the runner's traffic (ids
        included, 8 bytes each), as the synchronous exchange counts them."""
        row_bytes = table.dtype.itemsize * int(torch.Size(table.row_shape).numel())
        counts = [0] * self.world_size
        counts[server] = rows
        zero = [0] * self.world_size
        self.traffic.record(table.name, counts, zero, 8)  # the ids always go out
        if received:
            self.traffic.record(table.name, zero, counts, row_bytes)
        else:
            self.traffic.record(table.name, counts, zero, row_bytes)

    # ---- consistent snapshots, and the end ---------------------------------------------
    @contextlib.contextmanager
    def quiet(self, group: dist.ProcessGroup) -> Iterator[None]:
        """While inside, no push or pull is in flight anywhere and every push is applied:
        a barrier on entry (every worker has its pushes acknowledged) and on exit (nobody
        resumes while another still reads the shards). Collective; nests."""
        self._quiet_depth += 1
        try:
            if self._quiet_depth == 1 and self.world_size > 1:
                dist.barrier(group=group)
            yield
            if self._quiet_depth == 1 and self.world_size > 1:
                dist.barrier(group=group)
        finally:
            self._quiet_depth -= 1

    def close(self) -> None:
        """This worker is done: its clock stops holding others back, every server is told,
        and this process's server serves until every other worker is done too."""
        if self.closed:
            return
        self.closed = True
        self.gate.close()
        try:
            for server in self.server_ranks:
                if server != self.rank:
                    self.channel.send(self.channel.header(STOP, self.step, [0] * len(self.inner)),
                                      server, _HEADER).wait(self.channel.timeout)
            if self.thread is not None and not failing.failing():
                self.thread.join(self.timeout_s)
            elif self.thread is not None:
                return  # failing: the others learn it from the closed connections
        except Exception as error:  # a peer already gone: its own error says why
            if not failing.failing():  # else this process's own error says more
                log.warning("parallax: rank %d: asynchronous servers did not stop cleanly: "
                            "%s", self.rank, error)
        else:
            dist.destroy_process_group(self.channel.group)
