"""Asynchronous parameter servers (`Config.sync` ``"async"`` / ``"async-sparse"``): each server
process answers pulls and applies pushes as they arrive, with no step barrier.

Transport: c10d point-to-point on a gloo group of its own (`AsyncChannel`), served by one
thread per server process (`ServerThread`) that blocks in a receive from any source. Not
``torch.distributed.rpc``: it is in maintenance mode, needs its own TensorPipe agent and rendezvous
beside the process groups, and offers nothing this needs beyond send/recv; measured (torch 2.13
CPU, gloo): a thread receiving from any source on its own group runs beside the main thread's
collectives and point-to-point on the same group without deadlock or lost messages.

Protocol: a request is a header ``[kind, rank, step, count per table]`` (tag ``_HEADER``, taken
from any source), then from that source the ids (int64, the tables' ids one after the other;
tag ``_IDS``) and, for a push, one gradient tensor per table with rows (tag ``_GRADS``). The
reply (a pull's rows, one tensor per table with rows; a push's acknowledgement once it is
applied) goes back with tag ``_REPLY``. A worker has at most one request outstanding per
server, so replies need no matching. A server rank's own worker is served in its process,
under the same lock (gloo cannot send to its own rank).

What a push does (`ServerState.push`): ``aggregate`` False (the asynchronous modes): one update
of the user's optimizer on every table of this server, with that worker's gradient (divided by
the worker count when averaging) — as an asynchronous parameter server applies each worker's
gradient. ``aggregate`` True (``max_staleness=0``): the pushes of a step are summed and applied
as one update once every worker's has arrived (the synchronous update, exact for every
optimizer); their acknowledgements go out then, which is what keeps the workers in step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from parallax.engine.optimizers.shard_optimizer import ShardOptimizer
from parallax.engine.tables.server_table import ShardedTable
from parallax.errors import AsyncServerError

__all__ = ["PULL", "PUSH", "SKIP", "AsyncChannel", "AsyncServerError", "ServerState",
           "ServerThread"]

PULL, PUSH, SKIP, STOP = 1, 2, 3, 4
_HEADER, _IDS, _GRADS, _REPLY = 11, 12, 13, 14
_KINDS = {PULL: "pull", PUSH: "push", SKIP: "skipped push", STOP: "stop"}
# the idle receive of a server thread: it ends on every worker's stop message or a peer's
# failure (gloo reports closed connections at once), not on a clock; the workers' own waits
# keep Config.collective_timeout_s
_IDLE = timedelta(days=30)


class AsyncChannel:
    """The point-to-point group and the message layout shared by workers and servers."""

    def __init__(self, tables: Sequence[ShardedTable], *, rank: int, timeout_s: float):
        self.tables = list(tables)
        self.rank = rank
        self.timeout = timedelta(seconds=timeout_s)
        # collective (every rank): created in the same order everywhere
        self.group = dist.new_group(backend="gloo", timeout=_IDLE)

    def header(self, kind: int, step: int, counts: Sequence[int]) -> Tensor:
        return torch.tensor([kind, self.rank, step, *counts], dtype=torch.long)

    def empty_header(self) -> Tensor:
        return torch.zeros(3 + len(self.tables), dtype=torch.long)

    def rows(self, table: int, count: int) -> Tensor:
        t = self.tables[table]
        return torch.empty((count, *t.row_shape), dtype=t.dtype)

    def send(self, tensor: Tensor, dst: int, tag: int) -> dist.Work:
        work: dist.Work = self.group.send([tensor.contiguous()], dst, tag)
        return work

    def recv(self, tensor: Tensor, src: int, tag: int, what: str) -> Tensor:
        """Receive into ``tensor`` from ``src``, waiting at most the run's timeout."""
        try:
            self.group.recv([tensor], src, tag).wait(self.timeout)
        except RuntimeError as error:
            raise AsyncServerError(
                f"rank {self.rank}: no {what} from rank {src} within "
                f"{self.timeout.total_seconds():g} s (Config.collective_timeout_s): rank {src} "
                f"stopped, crashed or hangs. The wait ended with: "
                f"{str(error).strip().splitlines()[0] if str(error).strip() else error!r}"
            ) from error
        return tensor


class ServerState:
    """One server process's tables under asynchronous training, and what pulls and pushes do
    to them. Every method takes the lock: the server thread and the process's own worker
    (and checkpoints) share the shards."""

    def __init__(self, tables: Sequence[ShardedTable], *, world_size: int, aggregate: bool,
                 rank: int, timeout_s: float):
        self.tables = list(tables)
        self.world_size = world_size
        self.aggregate = aggregate
        self.rank = rank
        self.timeout_s = timeout_s
        self.lock = threading.RLock()
        self.applied = threading.Condition(self.lock)
        self.optimizer: ShardOptimizer | None = None  # set once the runner has built it
        self.updates = 0        # optimizer steps applied (one per push, or per step)
        self.applied_rows: dict[str, Tensor] = {}  # per table: sum of applied gradient rows
        self.count_applied = False  # tests: keep `applied_rows` (costs an index_add per push)
        self._round: list[int] = []  # aggregate: the ranks whose push of `_round_step` came
        self._round_step = 0
        self.done_step = 0  # aggregate: the last step applied

    def pull(self, counts: Sequence[int], ids: Tensor) -> list[Tensor]:
        """The current rows of ``ids`` (global ids, ``counts[i]`` of table ``i``), one tensor
        per table with rows."""
        out = []
        with self.lock:
            for table, table_ids in self._split(counts, ids):
                local = table.shard_rows_of(table_ids)
                if table.before_read is not None:
                    table.before_read(local)  # deferred steps first
                out.append(table.server_shard().detach()[local].clone())
        return out

    def push(self, rank: int, step: int, counts: Sequence[int], ids: Tensor,
             grads: Sequence[Tensor], *, skip: bool = False) -> list[int]:
        """Take worker ``rank``'s gradient rows of ``step``; returns the ranks whose push is
        now applied (to acknowledge)."""
        with self.lock:
            if not self.aggregate:
                if not skip:
                    self._zero()
                    self._add(counts, ids, grads)
                    self._step()
                return [rank]
            if not self._round:
                self._round_step = step
                self._zero()
            if step != self._round_step or rank in self._round:
                raise AsyncServerError(
                    f"rank {self.rank}'s server: rank {rank} pushed step {step} while step "
                    f"{self._round_step} waits for ranks "
                    f"{sorted(set(range(self.world_size)) - set(self._round))} "
                    f"(max_staleness=0 applies a step once every worker pushed it)")
            self._round.append(rank)
            if not skip:
                self._add(counts, ids, grads)
            if len(self._round) < self.world_size:
                return []
            self._step()
            done, self._round = self._round, []
            self.done_step = step
            self.applied.notify_all()
            return done

    def wait_applied(self, step: int, check: Callable[[], None] | None = None) -> None:
        """Block until ``step`` is applied (aggregate mode; the local worker's acknowledgement).
        ``check`` is called every half second: it raises what the server thread failed with,
        which would otherwise leave this wait to its timeout."""
        deadline = time.monotonic() + self.timeout_s
        with self.lock:
            while not self.applied.wait_for(lambda: self.done_step >= step,
                                            min(0.5, max(0.0, deadline - time.monotonic()))):
                if check is not None:
                    check()
                if time.monotonic() >= deadline:
                    missing = sorted(set(range(self.world_size)) - set(self._round))
                    raise AsyncServerError(
                        f"rank {self.rank}: step {step} was not applied within "
                        f"{self.timeout_s:g} s (Config.collective_timeout_s): rank(s) {missing} "
                        f"did not push it")

    def _split(self, counts: Sequence[int], ids: Tensor) -> list[tuple[ShardedTable, Tensor]]:
        pieces = ids.split([int(c) for c in counts])
        return [(table, piece) for table, piece in zip(self.tables, pieces, strict=True)
                if piece.numel()]

    def _zero(self) -> None:
        for table in self.tables:
            if table.shard is not None:
                table.zero_grad()

    def _add(self, counts: Sequence[int], ids: Tensor, grads: Sequence[Tensor]) -> None:
        received = iter(grads)
        for table, table_ids in self._split(counts, ids):
            values = next(received).to(table.dtype)
            if self.count_applied:
                total = self.applied_rows.setdefault(
                    table.name, torch.zeros((table.num_rows, *table.row_shape),
                                            dtype=table.dtype))
                total.index_add_(0, table_ids, values)
            if table.average:
                values = values / self.world_size
            table.accumulate(table.shard_rows_of(table_ids), values)

    def _step(self) -> None:
        for table in self.tables:
            if table.shard is not None:
                table.finish_aggregation()
        if self.optimizer is not None:
            self.optimizer.step()
        self.updates += 1


class ServerThread:
    """The receive loop of one server process: pulls answered, pushes applied, until every
    other rank said stop (or a peer failed: the error is kept for the main thread)."""

    def __init__(self, channel: AsyncChannel, state: ServerState, world_size: int):
        self.channel = channel
        self.state = state
        self.world_size = world_size
        self.error: BaseException | None = None
        self.stopped: set[int] = set()
        self.last_message = time.monotonic()
        # replies in flight: a gloo send completes only once its receiver posts the receive,
        # and a worker takes its replies server by server; a server that waited on each send
        # could wait on a worker that waits on another server blocked the same way (seen once:
        # a 2x2 max_staleness=0 run hung), so replies are left in flight and reaped later
        # (gloo's send work holds its tensor until it completes)
        self.in_flight: list[dist.Work] = []
        self.thread = threading.Thread(target=self._run, name="parallax-async-server",
                                       daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        try:
            while len(self.stopped) < self.world_size - 1:
                self._serve_one()
                self._reap()
            for work in self.in_flight:  # every worker stopped: it took its replies
                work.wait(self.channel.timeout)
        except BaseException as error:  # kept for the main thread, which raises it
            self.error = error

    def _serve_one(self) -> None:
        channel = self.channel
        header = channel.empty_header()
        work = channel.group.recv_anysource([header], _HEADER)
        work.wait()
        self.last_message = time.monotonic()
        kind, src, step = (int(v) for v in header[:3])
        counts = [int(c) for c in header[3:]]
        if kind == STOP:
            self.stopped.add(src)
            return
        ids = torch.empty(sum(counts), dtype=torch.long)
        if ids.numel():
            channel.recv(ids, src, _IDS, f"ids of a {_KINDS.get(kind, kind)}")
        if kind == PULL:
            for rows in self.state.pull(counts, ids):
                self._reply(rows, src)
            return
        grads = [channel.recv(channel.rows(i, c), src, _GRADS, "gradient rows")
                 for i, c in enumerate(counts) if c]
        for rank in self.state.push(src, step, counts, ids, grads, skip=kind == SKIP):
            self.acknowledge(rank)

    def acknowledge(self, rank: int) -> None:
        """Tell ``rank`` its push is applied (the local worker is woken by the condition)."""
        if rank != self.channel.rank:
            self._reply(torch.ones(1), rank)

    def _reply(self, tensor: Tensor, rank: int) -> None:
        """Send without waiting for ``rank`` to take it (see ``in_flight``)."""
        self.in_flight.append(self.channel.send(tensor, rank, _REPLY))

    def _reap(self) -> None:
        """Forget the replies taken; a failed one raises here."""
        still = []
        for work in self.in_flight:  # completion read once: one that ends meanwhile waits
            if work.is_completed():
                work.wait()  # raises what the send failed with
            else:
                still.append(work)
        self.in_flight = still

    def join(self, timeout_s: float) -> None:
        """Wait until every other rank said stop: as long as messages keep coming (slower
        workers still train), then at most ``timeout_s`` of silence."""
        while self.thread.is_alive():
            self.thread.join(0.05)
            if time.monotonic() - self.last_message > timeout_s:
                missing = sorted(set(range(self.world_size)) - self.stopped
                                 - {self.channel.rank})
                raise AsyncServerError(
                    f"rank {self.channel.rank}: its server heard nothing for {timeout_s:g} s "
                    f"(Config.collective_timeout_s) while rank(s) {missing} had not finished "
                    f"their training: they stopped, crashed or hang")
        if self.error is not None:
            raise AsyncServerError(
                f"rank {self.channel.rank}: its server thread failed: {self.error}"
            ) from self.error
