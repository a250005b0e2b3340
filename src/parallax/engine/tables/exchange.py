"""One hop of the sparse exchange, and the bytes it moves.

A `Hop` is one ``all_to_all_single`` over the whole world with split sizes fixed, per table,
when it is opened; it can carry several payloads the same way (ids, then rows) and carry
payloads back the opposite way (rows to the requesters, gradients to the owners). One hop
serves all tables of a step at once, so a step costs a few collectives, not a few per table.
Ranks with nothing to send or receive take part with zero counts, so every rank issues the
same collectives in the same order.

Opening a hop exchanges the counts first, in their own small all_to_all, because gloo does not
check that both sides' splits agree; that message also carries an error flag so that a bad id on
one rank fails every rank at once instead of leaving the others waiting.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from parallax.engine import process_group
from parallax.errors import ArgumentTypeError, InternalError, SparseIdError

COUNT_MESSAGE_BYTES = 3 * 8  # count, error flag, bad id: int64 each
#: ids travel as int32 where every table of a message has at most this many rows
INT32_ROWS = 2**31


def wire_id_dtype(num_rows: Sequence[int]) -> torch.dtype:
    """The dtype ids travel in for tables of ``num_rows`` rows: int32 where all fit (half
    the bytes of int64, the dtype ids are kept in), int64 otherwise. Out-of-range ids may
    wrap on the way; they are flagged in the same message and refused on every rank before
    anyone reads them."""
    return torch.int32 if all(n <= INT32_ROWS for n in num_rows) else torch.int64


def all_to_all(out: Tensor, message: Tensor, recv_splits: Sequence[int] | None = None,
               send_splits: Sequence[int] | None = None, *, group: dist.ProcessGroup | None,
               async_op: bool = False) -> dist.Work | None:
    """``dist.all_to_all_single``, except in a group of one rank, whose message is what it
    receives: copied here, without the collective (on a GPU an all_to_all of one rank still
    launches NCCL's kernels; on a CPU it still goes through gloo). None: nothing to wait for."""
    if process_group.size(group) == 1:
        out.copy_(message)
        return None
    return process_group.all_to_all_single(out, message, recv_splits, send_splits,
                                           group=group, async_op=async_op)


def peer_splits(names: Sequence[str], counts: dict[str, list[int]],
                item: dict[str, int]) -> list[int]:
    """Per peer, the sum over the tables ``names`` of their ``counts`` to (from) it, each
    count times the table's ``item`` (its bytes, or 1: items). (Loops, not a generator per
    peer: every exchange of a step works these out.)"""
    splits = [0] * len(counts[names[0]])
    for name in names:
        size = item[name]
        for peer, count in enumerate(counts[name]):
            splits[peer] += count * size
    return splits


def exchange_counts(message: Tensor, *, group: dist.ProcessGroup | None,
                    device: torch.device | None) -> Tensor:
    """A host ``message`` of counts sent through ``device`` (NCCL moves device tensors only)
    and received back on the host. In a group of one rank it is its own answer and stays on
    the host: on a GPU the trip would cost two copies and a synchronisation for nothing."""
    if process_group.size(group) == 1:
        return message
    sent = message.to(device, non_blocking=True)  # (a blocking copy would wait on a GPU)
    received = torch.empty_like(sent)
    all_to_all(received, sent, group=group)
    return received.cpu()


def read_back(vectors: Sequence[Tensor]) -> list[list[int]]:
    """Each of several small 1-D integer tensors' values, read to the host in one transfer
    (on a GPU each read-back is a wait for the device)."""
    if len(vectors) <= 1:
        return [vector.tolist() for vector in vectors]
    values, at, out = torch.cat(list(vectors)).tolist(), 0, []
    for vector in vectors:
        out.append(values[at:at + vector.numel()])
        at += vector.numel()
    return out


def with_header(header: Tensor, ids_dtype: torch.dtype) -> Tensor:
    """An int64 ``header`` as ``ids_dtype`` values, to open a message of such ids (two int32
    values per int64 where the ids are int32; `header_of` reads it back)."""
    return header.contiguous().view(ids_dtype).reshape(-1)


def header_of(parts: Sequence[Tensor], fields: int) -> Tensor:
    """The int64 headers of ``fields`` values each that open ``parts`` (one per sender, in
    the message's dtype), as ``[sender, fields]`` on CPU."""
    if not parts:
        return torch.empty(0, fields, dtype=torch.int64)
    width = fields * 8 // parts[0].element_size()
    return torch.stack([part[:width] for part in parts]).cpu().view(torch.int64)


def unique_ids(ids: Tensor, num_rows: int, name: str, rank: int,
               ) -> tuple[Tensor, Tensor, int | None]:
    """``(unique, inverse, bad_id)`` of a lookup's ids: sorted unique ids, the index of each
    id among them, and an id outside ``[0, num_rows)`` (or None) for `Hop.open` to report to
    every rank. Ids must be integers: float ids would be truncated silently."""
    return unique_ids_many([ids], [num_rows], [name], rank)[0]


def unique_ids_many(ids: Sequence[Tensor], num_rows: Sequence[int], names: Sequence[str],
                    rank: int) -> list[tuple[Tensor, Tensor, int | None]]:
    """`unique_ids` of several tables' ids, with the ends of all their unique ids read back in
    one transfer (on a GPU each read-back is a wait for the device)."""
    found = []
    for table_ids, name in zip(ids, names, strict=True):
        if table_ids.dtype not in (torch.int64, torch.int32):  # (inline: every pull asks)
            _require_integer(table_ids, name, rank)
        found.append(torch.unique(flat_long(table_ids), return_inverse=True))
    return _with_bad_ids(found, ids, num_rows)


def sorted_ids_many(ids: Sequence[Tensor], num_rows: Sequence[int], names: Sequence[str],
                    rank: int) -> list[tuple[Tensor, Tensor, int | None]]:
    """`unique_ids_many` without the dedup: each table's ids sorted, repeats kept (every
    lookup's id travels: `Config.id_dedup` ``"servers"``), the inverse placing each id."""
    found = []
    for table_ids, name in zip(ids, names, strict=True):
        _require_integer(table_ids, name, rank)
        flat = flat_long(table_ids)
        ordered, order = torch.sort(flat, stable=True)
        inverse = torch.empty_like(order).scatter_(
            0, order, torch.arange(order.numel(), device=order.device))
        found.append((ordered, inverse))
    return _with_bad_ids(found, ids, num_rows)


def _require_integer(ids: Tensor, name: str, rank: int) -> None:
    if ids.dtype not in (torch.int64, torch.int32):
        raise ArgumentTypeError(f"parameter '{name}' on rank {rank}: ids must be an "
                                f"integer tensor, got {ids.dtype}")


def _with_bad_ids(found: list[tuple[Tensor, Tensor]], ids: Sequence[Tensor],
                  num_rows: Sequence[int]) -> list[tuple[Tensor, Tensor, int | None]]:
    """Each table's sorted ids and inverse (shaped like its ``ids``) with an id outside its
    rows (or None), the ends of all of them read back in one transfer."""
    # sorted: each one's ends (a strided view, not an indexing op)
    ends = read_back([unique[::unique.numel() - 1] if unique.numel() > 1 else unique
                      for unique, _ in found])
    result = []
    for (unique, inverse), table_ids, rows, low_high in zip(found, ids, num_rows, ends,
                                                            strict=True):
        bad_id = None
        if low_high:
            low, high = low_high[0], low_high[-1]
            bad_id = low if low < 0 else high if high >= rows else None
        result.append((unique, inverse if table_ids.dim() == 1 else inverse.view(table_ids.shape),
                       bad_id))
    return result


def flat_long(ids: Tensor) -> Tensor:
    """``ids`` as one int64 vector (itself where it is one: no view or conversion op)."""
    flat = ids if ids.dim() == 1 else ids.reshape(-1)
    return flat if flat.dtype == torch.int64 else flat.long()


@dataclass
class Traffic:
    """Bytes this rank sent and received, per parameter, within and across machines.

    Self-traffic (a worker talking to its own server) crosses nothing and is not counted.
    """

    rank: int
    machine_of_rank: tuple[int, ...]
    steps: int = 0
    bytes: dict[str, dict[str, int]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(int)))
    _keys: list[tuple[int, str, str]] | None = field(default=None, init=False, repr=False)

    def record(self, name: str, send_counts: list[int], recv_counts: list[int],
               bytes_per_item: int) -> None:
        world = len(self.machine_of_rank)
        if len(send_counts) != world or len(recv_counts) != world:
            raise InternalError(f"'{name}': {len(send_counts)} send and {len(recv_counts)} "
                                f"receive counts for {world} ranks; please report it")
        peers = self._keys if self._keys is not None else self._peer_keys()
        if not peers:  # a world of one: all of it self-traffic
            return
        counts = self.bytes[name]
        for peer, sent_key, received_key in peers:  # every step: kept short
            counts[sent_key] += send_counts[peer] * bytes_per_item
            counts[received_key] += recv_counts[peer] * bytes_per_item

    def record_many(self, entries: Sequence[tuple[str, list[int], list[int]]],
                    bytes_per_item: int) -> None:
        """`record` of each ``(name, send counts, receive counts)`` (a table group's members
        in one message), in one call."""
        world = len(self.machine_of_rank)
        if any([len(send) != world or len(receive) != world for _, send, receive in entries]):
            raise InternalError(f"{[name for name, _, _ in entries]}: send or receive counts "
                                f"not of {world} ranks; please report it")
        peers = self._keys if self._keys is not None else self._peer_keys()
        if not peers:
            return
        for name, send, receive in entries:
            counts = self.bytes[name]
            for peer, sent_key, received_key in peers:
                counts[sent_key] += send[peer] * bytes_per_item
                counts[received_key] += receive[peer] * bytes_per_item

    def record_to_every_peer(self, name: str, payload: int) -> None:
        """``payload`` bytes sent to every other rank and as many received from each (an
        all_to_all of one whole payload per peer; `record` without its count lists)."""
        peers = self._keys if self._keys is not None else self._peer_keys()
        if not peers:  # a world of one: all of it self-traffic
            return
        counts = self.bytes[name]
        for _, sent_key, received_key in peers:
            counts[sent_key] += payload
            counts[received_key] += payload

    def record_to_every_peer_many(self, payloads: Sequence[tuple[str, int]]) -> None:
        """`record_to_every_peer` of each ``(name, bytes)`` (the pieces of one payload)."""
        peers = self._keys if self._keys is not None else self._peer_keys()
        if not peers:
            return
        for name, payload in payloads:
            counts = self.bytes[name]
            for _, sent_key, received_key in peers:
                counts[sent_key] += payload
                counts[received_key] += payload

    def _peer_keys(self) -> list[tuple[int, str, str]]:
        """``(peer, sent key, received key)`` of every other rank, worked out once."""
        mine = self.machine_of_rank[self.rank]
        self._keys = []
        for peer, machine in enumerate(self.machine_of_rank):
            if peer != self.rank:
                where = "intra" if machine == mine else "inter"
                self._keys.append((peer, f"{where}_sent", f"{where}_received"))
        return self._keys

    def record_ring_allreduce(self, name: str, payload_bytes: int) -> None:
        """An AllReduce of ``payload_bytes`` done by gloo's ring: reduce-scatter then
        all-gather, each rank sending ``2 (W-1)/W`` of the payload to its successor and
        receiving as much from its predecessor. Derived from the schedule, not read off a
        socket: DDP and c10d do not report their bytes."""
        world = len(self.machine_of_rank)
        if world == 1:
            return
        self.record_ring(name, 2 * (world - 1) * payload_bytes // world)

    def record_ring_allgather(self, name: str, payload_bytes: int) -> None:
        """An all_gather of ``payload_bytes`` from every rank by gloo's ring: each rank passes
        the ``W-1`` payloads that are not its successor's own to it."""
        world = len(self.machine_of_rank)
        if world == 1:
            return
        self.record_ring(name, (world - 1) * payload_bytes)

    def record_ring(self, name: str, volume: int, ranks: list[int] | None = None) -> None:
        """``volume`` bytes sent to this rank's successor in a ring over ``ranks`` (default:
        every rank; a subgroup's, e.g. a model or data group of `parallax.parallelism`) and
        as many received from its predecessor."""
        world = len(self.machine_of_rank)
        ring = list(range(world)) if ranks is None else ranks
        n, position = len(ring), ring.index(self.rank)
        sent, received = [0] * world, [0] * world
        sent[ring[(position + 1) % n]] = volume
        received[ring[(position - 1) % n]] = volume
        self.record(name, sent, received, 1)

    def record_hierarchical_allreduce(self, name: str, payload_bytes: int, *, leader: int,
                                      num_machines: int) -> None:
        """A `parallax.engine.tables.hierarchy.all_reduce`: inside the machine, each worker sends
        its payload to the leader and gets the sum back (counted as direct transfers); across
        machines, the leaders' ring sends ``2 (N-1)/N`` of the payload to the next leader."""
        world = len(self.machine_of_rank)
        sent, received = [0] * world, [0] * world
        mine = self.machine_of_rank[self.rank]
        if self.rank != leader:
            sent[leader] = received[leader] = payload_bytes
        else:
            for peer in range(world):
                if peer != leader and self.machine_of_rank[peer] == mine:
                    sent[peer] = received[peer] = payload_bytes
            leaders = [self.machine_of_rank.index(m) for m in range(num_machines)]
            volume = 2 * (num_machines - 1) * payload_bytes // num_machines
            position = leaders.index(leader)
            sent[leaders[(position + 1) % num_machines]] += volume
            received[leaders[(position - 1) % num_machines]] += volume
        self.record(name, sent, received, 1)

    def per_step(self) -> dict[str, dict[str, float]]:
        steps = max(self.steps, 1)
        return {name: {k: v / steps for k, v in sorted(counts.items())}
                for name, counts in sorted(self.bytes.items())}

    def reset(self) -> None:
        self.steps = 0
        self.bytes.clear()


BAD_ID = 1  # a count message's flag: the sender has an id outside the table's rows


def raise_bad_ids(fields: list[list[list[int]]], names: Sequence[str], *, traffic: Traffic,
                  num_rows: dict[str, int]) -> None:
    """`SparseIdError` for the first bad id in the count messages received, ``fields``
    (``[peer][table][count, flags, bad id]``, read back once), on every rank alike."""
    for t, name in enumerate(names):
        failed = [peer for peer, tables in enumerate(fields) if tables[t][1] & BAD_ID]
        if failed:
            rank = failed[0]
            machine = traffic.machine_of_rank[rank]
            raise SparseIdError(
                f"parallax: sparse parameter '{name}' got id {fields[rank][t][2]} "
                f"on rank {rank} (machine {machine}), outside its rows "
                f"[0, {num_rows[name]})")


@dataclass
class Hop:
    """One all_to_all for several tables at once, with splits fixed per table and peer:
    `forward_many` sends each table's payload along them, `backward_many` against them.

    Payloads of all tables travel in one message, viewed as bytes (tables may differ in row
    width and dtype); on every rank each table's payload is sorted by peer and has the table's
    row shape and dtype, so both sides can cut the message into the same pieces.
    """

    send_counts: dict[str, list[int]]
    recv_counts: dict[str, list[int]]
    group: dist.ProcessGroup
    traffic: Traffic
    #: the parameter each payload's bytes are counted for, where its name is not one
    accounts: dict[str, str] | None = None
    #: payloads that are not a parameter's traffic (a rider such as the step's verdict)
    unaccounted: frozenset[str] = frozenset()
    #: a table group's payload (`parallax.engine.tables.table_group`): each member's name and
    #: its counts to and from each peer in the forward direction, its bytes counted as its own
    shares: dict[str, list[tuple[str, list[int], list[int]]]] | None = None

    @classmethod
    def open(cls, send_counts: list[int], *, group: dist.ProcessGroup, traffic: Traffic,
             name: str, num_rows: int, bad_id: int | None = None,
             device: torch.device | None = None) -> Hop:
        """`open_many` for one table."""
        return cls.open_many({name: send_counts}, group=group, traffic=traffic,
                             num_rows={name: num_rows}, bad_ids={name: bad_id}, device=device)

    @classmethod
    def open_many(cls, send_counts: dict[str, list[int]], *, group: dist.ProcessGroup,
                  traffic: Traffic, num_rows: dict[str, int],
                  bad_ids: dict[str, int | None] | None = None,
                  device: torch.device | None = None) -> Hop:
        """Exchange every table's counts in one message (and any bad id, raising
        `SparseIdError` on every rank)."""
        names = list(send_counts)
        world = len(send_counts[names[0]]) if names else dist.get_world_size(group)
        bad = [(bad_ids or {}).get(name) for name in names]
        fields = [[[send_counts[name][peer], 0 if b is None else BAD_ID, 0 if b is None else b]
                   for name, b in zip(names, bad, strict=True)] for peer in range(world)]
        received = fields  # a group of one receives what it sends
        if world > 1:  # (one read-back of every field: on a GPU each read is a wait)
            message = torch.tensor(fields, dtype=torch.long).view(world, len(names), 3)
            received = exchange_counts(message, group=group, device=device).tolist()
        for name in names:
            traffic.record(name, [1] * world, [1] * world, COUNT_MESSAGE_BYTES)
        raise_bad_ids(received, names, traffic=traffic, num_rows=num_rows)
        recv_counts = {name: [received[peer][t][0] for peer in range(world)]
                       for t, name in enumerate(names)}
        return cls(dict(send_counts), recv_counts, group, traffic)

    def forward(self, payload: Tensor) -> Tensor:
        """`forward_many` for a hop of one table."""
        (name,) = self.send_counts
        return self.forward_many({name: payload})[name]

    def backward(self, payload: Tensor) -> Tensor:
        (name,) = self.send_counts
        return self.backward_many({name: payload})[name]

    def forward_many(self, payloads: dict[str, Tensor]) -> dict[str, Tensor]:
        return self._start(payloads, self.send_counts, self.recv_counts, async_op=False)()

    def backward_many(self, payloads: dict[str, Tensor]) -> dict[str, Tensor]:
        return self._start(payloads, self.recv_counts, self.send_counts, async_op=False)()

    def start_forward_many(self, payloads: dict[str, Tensor],
                           ) -> Callable[[], dict[str, Tensor]]:
        """`forward_many` without waiting: the all_to_all is issued now (this rank's place
        in the group's order of collectives is taken now) and the returned function waits
        for it (under the group's timeout) and returns what arrived."""
        return self._start(payloads, self.send_counts, self.recv_counts, async_op=True)

    def subset(self, names: Sequence[str]) -> Hop:
        """The same splits for the tables ``names`` only (their payloads in a message of
        their own: every rank must take the same subsets in the same order)."""
        return Hop({n: self.send_counts[n] for n in names},
                   {n: self.recv_counts[n] for n in names}, self.group, self.traffic,
                   self.accounts, self.unaccounted, self.shares)

    def carrying(self, key: str) -> Hop:
        """This hop with one more payload, ``key``: one row to and from every peer, in the
        same message (a rider, e.g. the step's verdict: `parallax.engine.tables.verdict`;
        not counted as any parameter's traffic)."""
        counts = next(iter(self.send_counts.values()), None)
        world = len(counts) if counts is not None else dist.get_world_size(self.group)
        return Hop({**self.send_counts, key: [1] * world},
                   {**self.recv_counts, key: [1] * world}, self.group, self.traffic,
                   self.accounts, self.unaccounted | {key}, self.shares)

    def _account(self, name: str) -> str:
        return name if self.accounts is None else self.accounts.get(name, name)

    def _record(self, name: str, send: list[int], receive: list[int], item: int) -> None:
        """Count payload ``name``'s bytes (``item`` each), as its parameter's or, for a table
        group, as each member's (``send``: the counts it sends, forward or backward)."""
        if name in self.unaccounted:
            return
        shares = None if self.shares is None else self.shares.get(name)
        if shares is None:
            self.traffic.record(self._account(name), send, receive, item)
            return
        if send is self.send_counts[name]:  # (forward: the members' counts as they are)
            self.traffic.record_many(shares, item)
        else:
            self.traffic.record_many([(member, from_peers, to_peers)
                                      for member, to_peers, from_peers in shares], item)

    def _start(self, payloads: dict[str, Tensor], send: dict[str, list[int]],
               receive: dict[str, list[int]], *, async_op: bool,
               ) -> Callable[[], dict[str, Tensor]]:
        names = list(self.send_counts)
        if names and len(send[names[0]]) == 1:  # a group of one: what it sends, copied
            copies = {name: payloads[name].clone(memory_format=torch.contiguous_format)
                      for name in names}
            return lambda: copies
        if len(names) == 1:  # one table: no byte views needed
            name = names[0]
            return self._start_one(name, payloads[name], send[name], receive[name], async_op)
        world = len(send[names[0]])
        payloads = {name: payloads[name].contiguous() for name in names}
        first = payloads[names[0]]
        for payload in payloads.values():  # (a loop: every message asks)
            if payload.dtype != first.dtype or payload.shape[1:] != first.shape[1:]:
                break
        else:  # one dtype and row shape (the tables' rows, ids): one message of rows
            return self._start_rows(names, payloads, send, receive, async_op)
        item = {name: p.element_size() * math.prod(p.shape[1:]) for name, p in payloads.items()}
        pieces = {name: p.reshape(-1).view(torch.uint8).split_with_sizes(
                      [count * item[name] for count in send[name]])
                  for name, p in payloads.items()}
        message = torch.cat([pieces[name][peer] for peer in range(world) for name in names])
        send_splits, recv_splits = peer_splits(names, send, item), peer_splits(
            names, receive, item)
        out = message.new_empty(sum(recv_splits))
        work = all_to_all(out, message, recv_splits, send_splits, group=self.group,
                          async_op=async_op)
        for name in names:
            self._record(name, send[name], receive[name], item[name])

        def finish() -> dict[str, Tensor]:
            if work is not None:
                work.wait()
            cut = out.split_with_sizes([receive[n][peer] * item[n] for peer in range(world)
                                        for n in names])
            result = {}
            for t, name in enumerate(names):
                payload = payloads[name]
                own = torch.cat([cut[peer * len(names) + t] for peer in range(world)])
                result[name] = own.view(payload.dtype).view(-1, *payload.shape[1:])
            return result

        return finish

    def _start_rows(self, names: list[str], payloads: dict[str, Tensor],
                    send: dict[str, list[int]], receive: dict[str, list[int]],
                    async_op: bool) -> Callable[[], dict[str, Tensor]]:
        """`_start` of payloads of one dtype and row shape: their rows side by side in one
        message, cut by rows (no byte views of each payload and back)."""
        world = len(send[names[0]])
        pieces = {name: payloads[name].split_with_sizes(send[name]) for name in names}
        message = torch.cat([pieces[name][peer] for peer in range(world) for name in names])
        ones = dict.fromkeys(names, 1)
        send_splits, recv_splits = peer_splits(names, send, ones), peer_splits(
            names, receive, ones)
        out = message.new_empty((sum(recv_splits), *message.shape[1:]))
        work = all_to_all(out, message, recv_splits, send_splits, group=self.group,
                          async_op=async_op)
        row_bytes = message.element_size() * math.prod(message.shape[1:])
        for name in names:
            self._record(name, send[name], receive[name], row_bytes)

        def finish() -> dict[str, Tensor]:
            if work is not None:
                work.wait()
            cut = out.split_with_sizes([receive[n][peer] for peer in range(world)
                                        for n in names])
            return {name: torch.cat([cut[peer * len(names) + t] for peer in range(world)])
                    for t, name in enumerate(names)}

        return finish

    def _start_one(self, name: str, payload: Tensor, send: list[int], receive: list[int],
                   async_op: bool) -> Callable[[], dict[str, Tensor]]:
        out = payload.new_empty((sum(receive), *payload.shape[1:]))
        payload = payload.contiguous()
        work = all_to_all(out, payload, receive, send, group=self.group, async_op=async_op)
        item_bytes = payload.element_size() * math.prod(payload.shape[1:])
        self._record(name, send, receive, item_bytes)

        def finish() -> dict[str, Tensor]:
            if work is not None:
                work.wait()
            return {name: out}

        return finish
