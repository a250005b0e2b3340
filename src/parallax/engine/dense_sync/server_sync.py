"""``plump`` and ``slim``: dense parameters synchronised by their *updates* through servers, as
in the Slim-DP paper (Plump-DP and Slim-DP), instead of AllReducing gradients.

Every worker trains its own copy of the dense parameters (its optimizer steps on its own
gradients; no DDP) and remembers, per value, what it last pulled (``base``). Every
``sync_every`` steps it communicates: it pushes ``w - base`` (its accumulated update) to the
servers and pulls their values. The dense values, flattened in parameter order, are split into
one contiguous range per server (the machines' leaders, as for the sparse tables); a server adds
the mean (`Config.average_dense`; else the sum) of the updates it receives to its range.

- Plump-DP: every value both ways, every round. With SGD (momentum, Nesterov, weight decay:
  updates linear in the gradient) and ``sync_every=1`` this is the single-device program with
  the global batch: the mean of the workers' updates is the update of the mean gradient.
- Slim-DP: a round moves only the server's *core* (its keys cached on the workers, sent once
  per selection) and each worker's random *explorer* (keys with the values); the values a
  worker did not sync keep their local update, which the next sync of that value carries. Every
  ``reselect_every``-th round is full (all updates arrive: nothing is lost), and the servers
  then re-select their cores from ``|w| + c·|Δw|`` (Δw: that round's aggregated update).

With a codec (`Config.qsgd`) pushed values travel quantised (Quant-DP through servers); pulls
are exact. Three all_to_alls per round (values, explorer keys, pulled values) whose split sizes
every rank knows beforehand, so no count exchange is needed. Model buffers (e.g. BatchNorm's
statistics) are broadcast from rank 0 at every round, as DDP does before each forward.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from parallax.config import SlimDP
from parallax.engine.dense_sync import slim_selection as sel
from parallax.engine.dense_sync.qsgd_codec import QSGDCodec
from parallax.engine.tables.exchange import Traffic
from parallax.errors import UnsupportedProgramError

#: names its bytes are counted under in `Runner.stats`
PUSH, KEYS, PULL, CORE_KEYS = ("dense (push)", "dense (explorer keys)", "dense (pull)",
                               "dense (core keys)")


class ServerSync:
    """Plump-DP (``slim`` None) or Slim-DP over ``params``, the dense parameters every worker
    trains a copy of. Built collectively (rank 0's values become everyone's and the servers')."""

    def __init__(self, params: Sequence[nn.Parameter], buffers: Sequence[Tensor], *,
                 slim: SlimDP | None, codec: QSGDCodec | None, rank: int, world: int,
                 server_ranks: Sequence[int], group: dist.ProcessGroup, traffic: Traffic,
                 average: bool, seed: int) -> None:
        dtypes = sorted({str(p.dtype) for p in params})
        if len(dtypes) != 1:
            raise UnsupportedProgramError(
                f"rank {rank}: dense_sync='plump'/'slim' flattens the dense parameters into one "
                f"vector, but they have dtypes {dtypes}; give them one dtype")
        self.params, self.buffers = list(params), list(buffers)
        self.slim, self.codec = slim, codec
        self.rank, self.world, self.group = rank, world, group
        self.servers = tuple(server_ranks)
        self.traffic, self.average, self.seed = traffic, average, seed
        self.dtype = params[0].dtype
        self.device = params[0].device
        self.rounds = 0
        self.seconds = 0.0  # spent in rounds (selection, coding and collectives included)
        self.choosing_seconds = 0.0  # of which drawing explorers and selecting cores
        flat = self.local_values()
        self.n = flat.numel()
        cuts = [self.n * s // len(self.servers) for s in range(len(self.servers) + 1)]
        self.ranges = [(cuts[s], cuts[s + 1]) for s in range(len(self.servers))]
        self.value_bytes = flat.element_size()
        self.key_dtype = torch.int32 if self.value_bytes <= 4 and self.n < 2**31 else torch.int64
        dist.broadcast(flat, src=0, group=group)  # one starting point, as DDP's
        self._write(flat)
        self.base = flat.clone()
        self.server = self.servers.index(rank) if rank in self.servers else None
        start, end = self.ranges[self.server] if self.server is not None else (0, 0)
        self.values = flat[start:end].clone()  # this server's range of the servers' model
        self.core: list[Tensor] = []  # per server, indices within its range (sorted)
        self.outside: list[Tensor] = []  # the rest of each range
        self.last_update: Tensor | None = None  # this server's last full round's aggregate
        if slim is not None:
            self._select_and_share(None)

    # ---- the worker's copy ---------------------------------------------------------------
    def local_values(self) -> Tensor:
        """This worker's dense values, flattened in parameter order (a copy)."""
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def _write(self, flat: Tensor) -> None:
        offset = 0
        with torch.no_grad():
            for param in self.params:
                param.copy_(flat[offset:offset + param.numel()].view_as(param))
                offset += param.numel()

    def global_values(self) -> Tensor:
        """The servers' dense values, flattened (collective: each server broadcasts its
        range)."""
        out = torch.empty(self.n, dtype=self.dtype, device=self.device)
        for s, (start, end) in enumerate(self.ranges):
            piece = self.values if s == self.server else out[start:end]
            dist.broadcast(piece, src=self.servers[s], group=self.group)
            out[start:end] = piece
        return out

    @contextlib.contextmanager
    def serving_global(self) -> Iterator[None]:
        """Inside: the parameters hold the servers' values (what training produced: the
        workers' copies differ between full rounds); this worker's own come back after."""
        mine = self.local_values()
        self._write(self.global_values())
        try:
            yield
        finally:
            self._write(mine)

    # ---- a round -------------------------------------------------------------------------
    def is_full(self, round_: int) -> bool:
        """Whether round ``round_`` (from 1) moves every value (always under Plump-DP)."""
        return self.slim is None or round_ % self.slim.reselect_every == 0

    def communicate(self) -> None:
        """One round: push this worker's accumulated updates, servers add them, pull back
        (collective)."""
        began = time.perf_counter()
        self.rounds += 1
        full = self.is_full(self.rounds)
        flat = self.local_values()
        delta = flat - self.base
        picks: list[Tensor | None] = [None] * len(self.servers)
        explorers: list[Tensor] = []
        if not full:
            assert self.slim is not None
            choosing = time.perf_counter()
            for s, (start, end) in enumerate(self.ranges):
                count = sel.explorer_size(end - start, self.slim.alpha, self.slim.beta)
                explorer = sel.draw_explorer(self.outside[s], count, sel.explorer_generator(
                    self.seed, self.rank, self.rounds, s))
                explorers.append(explorer)
                picks[s] = torch.cat([self.core[s], explorer])
            self.choosing_seconds += time.perf_counter() - choosing
        pushed = [self._pushed(delta, s, picks[s]) for s in range(len(self.servers))]
        received = self._to_servers([self._encode(values) for values in pushed], PUSH,
                                    self._push_size(full), torch.uint8 if self.codec else None)
        keys = None
        if not full:
            keys = self._to_servers([e.to(self.key_dtype) for e in explorers], KEYS,
                                    self._explorer_count(), self.key_dtype)
        replies = self._serve(received, keys, full)
        pulled = self._from_servers(replies, [self._count(s, full) for s in range(
            len(self.servers))])
        for s, (start, end) in enumerate(self.ranges):
            pick = picks[s]
            where = slice(start, end) if pick is None else start + pick
            flat[where] = pulled[s]
            self.base[where] = pulled[s]
        self._write(flat)
        for buffer in self.buffers:
            dist.broadcast(buffer, src=0, group=self.group)
        if full and self.slim is not None:
            self._select_and_share(self.last_update)
        self.seconds += time.perf_counter() - began

    def _pushed(self, delta: Tensor, s: int, pick: Tensor | None) -> Tensor:
        start, end = self.ranges[s]
        return delta[start:end] if pick is None else delta[start + pick]

    def _count(self, s: int, full: bool) -> int:
        """Values a worker syncs with server ``s`` this round."""
        start, end = self.ranges[s]
        if full:
            return end - start
        assert self.slim is not None
        return (sel.core_size(end - start, self.slim.beta)
                + sel.explorer_size(end - start, self.slim.alpha, self.slim.beta))

    def _explorer_count(self) -> int | None:
        """Explorer keys this server receives from each worker (None: not a server)."""
        if self.server is None:
            return None
        assert self.slim is not None
        start, end = self.ranges[self.server]
        return sel.explorer_size(end - start, self.slim.alpha, self.slim.beta)

    def _push_size(self, full: bool) -> int | None:
        """Items this server receives from each worker (None: not a server)."""
        if self.server is None:
            return None
        count = self._count(self.server, full)
        return self.codec.encoded_bytes(count, self.dtype) if self.codec else count

    def _encode(self, values: Tensor) -> Tensor:
        if self.codec is None:
            return values
        generator = sel.explorer_generator(self.seed + 1, self.rank, self.rounds, -1)
        return self.codec.encode(values, generator)

    def _serve(self, received: list[Tensor], keys: list[Tensor] | None, full: bool,
               ) -> list[Tensor]:
        """On a server: add the workers' updates to its range and return what each worker
        pulls; elsewhere nothing."""
        if self.server is None:
            return [self.values[:0]] * self.world
        count = self._count(self.server, full)
        core = self.core[self.server] if not full else None
        update = torch.zeros_like(self.values)
        picks: list[Tensor | None] = []
        for worker, payload in enumerate(received):
            values = (self.codec.decode(payload, count, self.dtype) if self.codec
                      else payload)
            if full:
                update += values
                picks.append(None)
                continue
            assert keys is not None and core is not None
            pick = torch.cat([core, keys[worker].long()])
            update.index_add_(0, pick, values)
            picks.append(pick)
        if self.average:
            update /= self.world
        self.values += update
        if full:
            self.last_update = update
        return [self.values.clone() if pick is None else self.values[pick] for pick in picks]

    def _select_and_share(self, update: Tensor | None) -> None:
        """Servers choose their cores; every worker receives every core's keys (collective)."""
        assert self.slim is not None
        mine = None
        choosing = time.perf_counter()
        if self.server is not None:
            start, end = self.ranges[self.server]
            mine = sel.select_core(self.values, update, sel.core_size(end - start,
                                                                      self.slim.beta),
                                   self.slim.significance).to(self.key_dtype)
        self.choosing_seconds += time.perf_counter() - choosing
        sizes = [sel.core_size(end - start, self.slim.beta) for start, end in self.ranges]
        cores = self._from_servers([mine] * self.world if mine is not None
                                   else [torch.empty(0, dtype=self.key_dtype)] * self.world,
                                   sizes, name=CORE_KEYS)
        choosing = time.perf_counter()
        self.core = [c.long() for c in cores]
        self.outside = [sel.complement(end - start, core)
                        for (start, end), core in zip(self.ranges, self.core, strict=True)]
        self.choosing_seconds += time.perf_counter() - choosing

    # ---- the collectives -----------------------------------------------------------------
    def _to_servers(self, per_server: list[Tensor], name: str, each: int | None,
                    dtype: torch.dtype | None) -> list[Tensor]:
        """Send ``per_server[s]`` to server ``s``; a server receives ``each`` items from every
        rank (returned per rank)."""
        dtype = dtype or self.dtype
        send = [torch.empty(0, dtype=dtype, device=self.device)] * self.world
        for s, tensor in enumerate(per_server):
            send[self.servers[s]] = tensor.to(dtype)
        recv = [each or 0] * self.world
        return self._all_to_all(send, recv, name)

    def _from_servers(self, per_rank: list[Tensor], sizes: list[int],
                      name: str = PULL) -> list[Tensor]:
        """Each server sends ``per_rank[r]`` to rank ``r``; returned per server."""
        recv = [0] * self.world
        for s, size in enumerate(sizes):
            recv[self.servers[s]] = size
        got = self._all_to_all(per_rank, recv, name)
        return [got[rank] for rank in self.servers]

    def _all_to_all(self, send: list[Tensor], recv: list[int], name: str) -> list[Tensor]:
        """One all_to_all_single: ``send[r]`` to rank ``r``, ``recv[r]`` items from it (every
        ``send`` tensor has the payload's dtype, empty ones too)."""
        flat_send = torch.cat([t.reshape(-1) for t in send])
        out = torch.empty(sum(recv), dtype=flat_send.dtype, device=self.device)
        sent = [t.numel() for t in send]
        dist.all_to_all_single(out, flat_send, output_split_sizes=recv,
                               input_split_sizes=sent, group=self.group)
        self.traffic.record(name, sent, recv, out.element_size())
        return list(out.split(recv))


def build_server_sync(module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], *,
                      sync: str, slim: SlimDP, codec: QSGDCodec | None, rank: int,
                      world: int, server_ranks: Sequence[int], group: dist.ProcessGroup,
                      traffic: Traffic, average: bool, seed: int) -> ServerSync | None:
    """The `ServerSync` of ``module``'s trainable parameters (None when it has none), after
    checking their optimizers: the workers' updates are averaged, which is Plump-DP's exact
    AllReduce equivalent only for an optimizer linear in the gradient (SGD)."""
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        return None
    mine = {id(p) for p in params}
    for optimizer in optimizers:
        holds = any(id(p) in mine for group_ in optimizer.param_groups
                    for p in group_["params"])
        if holds and not isinstance(optimizer, torch.optim.SGD):
            raise UnsupportedProgramError(
                f"rank {rank}: dense_sync={sync!r} averages the workers' own updates, which "
                f"equals training on the global batch only for an optimizer whose update is "
                f"linear in the gradient (torch.optim.SGD, with any momentum, Nesterov or "
                f"weight decay); the dense parameters are updated by "
                f"{type(optimizer).__name__}. Use torch.optim.SGD for them, or "
                f"dense_sync='hierarchical' / 'qsgd', which synchronise gradients.")
    return ServerSync(params, list(module.buffers()), slim=slim if sync == "slim" else None,
                      codec=codec, rank=rank, world=world, server_ranks=server_ranks,
                      group=group, traffic=traffic, average=average, seed=seed)
