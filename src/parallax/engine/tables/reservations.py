"""Opening a hop and sending its ids in one message.

`Hop.open_many` first exchanges the counts (gloo checks no split sizes, so both sides must know
them before the ids travel), then the ids: two all_to_alls before a pull can even serve rows,
and on a host whose cores the ranks share the count message alone costs 0.5 ms of CPU per rank
and 1.3 ms of wall time (2 machines x 2 workers, record small_sums-2x2-1gbit).
`open_carrying` sends the count message and the ids together: each rank reserves, per table and
peer, room for as many ids as the most it sent that peer over the last `HISTORY` pulls (its
`Reservations`), pads what it sends up to that, and sends whatever does not fit in a second
all_to_all that only happens when some rank ran out of room. Sender and receiver keep the same
history of the counts between them (both learn every count from the message), so they reserve
alike without a word (steady counts reserve exactly them, varying ones a quarter more than the
most seen); each message says whether its sender overflowed, so every rank knows whether the
second all_to_all comes.

Ids are padded, never dropped: the result is the same ids as `Hop.open_many` then
`Hop.forward_many` give, in the same order. The padding is counted as traffic; with steady
counts (as many ids per owner every step) there is none. Ids travel as int32 where every
table of the message fits (`parallax.engine.tables.exchange.wire_id_dtype`), the count
messages as int64 viewed in that dtype.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from parallax.engine.tables.exchange import (
    BAD_ID,
    COUNT_MESSAGE_BYTES,
    Hop,
    Traffic,
    all_to_all,
    header_of,
    peer_splits,
    raise_bad_ids,
    wire_id_dtype,
    with_header,
)

__all__ = ["HISTORY", "OVERFLOWED", "Reservations", "cut_rooms", "merge_rest", "open_carrying"]

HISTORY = 16  # pulls whose counts a reservation covers
OVERFLOWED = 2  # a count message's flag: the sender's ids did not all fit
_HEADER = COUNT_MESSAGE_BYTES // 8  # int64s per table and peer: count, flags, bad id


class Reservations:
    """One table's room for ids per peer in `open_carrying`: the most sent to (received
    from) each peer over the last `HISTORY` openings."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.reset()

    def reset(self) -> None:
        """Forget the counts (the rows moved: another partitioning, on every rank at once)."""
        self.sent: list[deque[int]] = [deque(maxlen=HISTORY) for _ in range(self.world)]
        self.received: list[deque[int]] = [deque(maxlen=HISTORY) for _ in range(self.world)]

    def rooms_to(self) -> list[int]:
        """The room for ids to each peer, in rank order."""
        return [_room(counts) for counts in self.sent]

    def rooms_from(self) -> list[int]:
        """The room for ids from each peer, in rank order."""
        return [_room(counts) for counts in self.received]

    def note(self, sent: Sequence[int], received: Sequence[int]) -> None:
        for peer in range(self.world):
            self.sent[peer].append(sent[peer])
            self.received[peer].append(received[peer])


def _room(counts: deque[int]) -> int:
    """Steady counts: exactly them. Varying ones: the most seen and a quarter more (random
    ids per owner vary like a binomial; the most of a few draws alone is exceeded about
    every ``HISTORY`` pulls by one of the ``W^2`` pairs, a quarter more almost never)."""
    if not counts:
        return 0
    most = max(counts)
    return most if min(counts) == most else most + most // 4 + 4


def open_carrying(payloads: dict[str, Tensor], send_counts: dict[str, list[int]], *,
                  reservations: dict[str, Reservations], group: dist.ProcessGroup,
                  traffic: Traffic, num_rows: dict[str, int],
                  bad_ids: dict[str, int | None],
                  members: dict[str, list[tuple[str, list[int]]]] | None = None,
                  ) -> tuple[Hop, dict[str, Tensor]]:
    """`Hop.open_many` and `Hop.forward_many` of the id ``payloads`` (1-D int64, sorted by
    peer, ``send_counts`` per peer), in one all_to_all where the reservations hold them,
    as int32 where the tables fit (`wire_id_dtype`). Returns the hop (exact counts, for the
    rows back and the gradients) and the ids each table received (int64), in peer order.

    ``members``: per payload of a table group (`parallax.engine.tables.table_group`), each
    member's name and counts per peer: the count message has an entry per member (its bad
    id named as its own; ``bad_ids`` and ``num_rows`` then name members too), and its bytes
    are counted as the member's."""
    names = list(payloads)
    world = len(send_counts[names[0]])
    entries = _entries(names, send_counts, members)
    wire = wire_id_dtype([num_rows[n] for n in names])
    header_width = len(entries) * _HEADER * 8 // wire.itemsize
    room_to = {n: reservations[n].rooms_to() for n in names}
    room_from = {n: reservations[n].rooms_from() for n in names}
    pieces = {n: payloads[n].to(wire).split_with_sizes(send_counts[n]) for n in names}
    overflowed = any(send_counts[n][p] > room_to[n][p] for n in names for p in range(world))
    sent_fields, headers_out = _headers(entries, bad_ids, overflowed, world,
                                        like=pieces[names[0]][0])
    message = torch.cat([part for peer in range(world) for part in _to_peer(
        peer, names, pieces, room_to, headers_out[peer])])
    ones = dict.fromkeys(names, 1)
    send_splits = [header_width + ids for ids in peer_splits(names, room_to, ones)]
    recv_splits = [header_width + ids for ids in peer_splits(names, room_from, ones)]
    out = message.new_empty(sum(recv_splits))
    all_to_all(out, message, recv_splits, send_splits, group=group)
    chunks = out.split_with_sizes(recv_splits)
    # [peer][entry][count, flags, bad id]: a group of one received what it sent (on a GPU a
    # read-back of it would be a wait for nothing)
    fields = ([sent_fields] if world == 1 else header_of(chunks, len(entries) * _HEADER).view(
        world, len(entries), _HEADER).tolist())
    raise_bad_ids(fields, [name for _, name, _ in entries], traffic=traffic, num_rows=num_rows)
    recv_counts, shares = _received_counts(entries, fields, world)
    _count_traffic(traffic, names, shares, room_to, room_from, wire.itemsize, world)
    received = cut_rooms(chunks, names, room_from, recv_counts, header=header_width)
    # every rank sees every sender's flag
    if any(table[1] & OVERFLOWED for peer in fields for table in peer):
        rest = Hop({n: [max(0, c - r) for c, r in zip(send_counts[n], room_to[n], strict=True)]
                    for n in names},
                   {n: [max(0, c - r) for c, r in zip(recv_counts[n], room_from[n], strict=True)]
                    for n in names}, group, traffic, unaccounted=frozenset(shares))
        more = rest.forward_many({n: torch.cat([piece[room_to[n][p]:]
                                                for p, piece in enumerate(pieces[n])])
                                  for n in names})
        received = {n: merge_rest(received[n], more[n].split(rest.recv_counts[n]))
                    for n in names}
    for name in names:
        reservations[name].note(send_counts[name], recv_counts[name])
    ids = {n: torch.cat(received[n]).long() for n in names}
    return Hop(dict(send_counts), recv_counts, group, traffic, shares=shares or None), ids


def _entries(names: list[str], send_counts: dict[str, list[int]],
             members: dict[str, list[tuple[str, list[int]]]] | None,
             ) -> list[tuple[str, str, list[int]]]:
    """The count message's entries, in order: ``(payload, entry name, its counts)``, one per
    table (per member of a group)."""
    entries = []
    for name in names:
        grouped = None if members is None else members.get(name)
        if grouped is None:
            entries.append((name, name, send_counts[name]))
        else:
            entries.extend((name, member, counts) for member, counts in grouped)
    return entries


def _received_counts(entries: list[tuple[str, str, list[int]]], fields: list[list[list[int]]],
                     world: int) -> tuple[dict[str, list[int]],
                                          dict[str, list[tuple[str, list[int], list[int]]]]]:
    """Per payload the counts received from each peer (a group's: its members' summed), and
    per group payload each member's ``(name, sent, received)`` counts."""
    recv_counts: dict[str, list[int]] = {}
    shares: dict[str, list[tuple[str, list[int], list[int]]]] = {}
    for e, (payload, name, sent) in enumerate(entries):
        received = [fields[peer][e][0] for peer in range(world)]
        if payload == name:
            recv_counts[payload] = received
            continue
        shares.setdefault(payload, []).append((name, sent, received))
        total = recv_counts.setdefault(payload, [0] * world)
        for peer in range(world):
            total[peer] += received[peer]
    return recv_counts, shares


def _count_traffic(traffic: Traffic, names: list[str],
                   shares: dict[str, list[tuple[str, list[int], list[int]]]],
                   room_to: dict[str, list[int]], room_from: dict[str, list[int]],
                   item: int, world: int) -> None:
    """The count messages' and the ids' bytes, per table: a table's reserved rooms (what
    overflows them is counted by its second all_to_all), a group's members' ids as they are
    (all of them, in the rooms or beyond) and its padding as its first member's."""
    for name in names:
        grouped = shares.get(name)
        if grouped is None:
            traffic.record(name, [1] * world, [1] * world, COUNT_MESSAGE_BYTES)
            traffic.record(name, room_to[name], room_from[name], item)
            continue
        traffic.record_to_every_peer_many([(member, COUNT_MESSAGE_BYTES)
                                           for member, _, _ in grouped])
        traffic.record_many(grouped, item)
        sent, got = [0] * world, [0] * world
        for _, to_peers, from_peers in grouped:
            for peer in range(world):
                sent[peer] += to_peers[peer]
                got[peer] += from_peers[peer]
        traffic.record(grouped[0][0],
                       [max(0, r - c) for r, c in zip(room_to[name], sent, strict=True)],
                       [max(0, r - c) for r, c in zip(room_from[name], got, strict=True)], item)


def _headers(entries: list[tuple[str, str, list[int]]], bad_ids: dict[str, int | None],
             overflowed: bool, world: int, *, like: Tensor,
             ) -> tuple[list[list[int]], Tensor]:
    """Every peer's count message, one row per peer: per entry its count, flags and bad id
    (int64, viewed in ``like``'s dtype: `with_header`), made on the host at once and moved
    to ``like``'s device in one copy that does not wait for the device; with the fields as
    the host made them (``[peer * entry][field]``)."""
    fields = []
    for peer in range(world):
        for _, name, counts in entries:
            bad = bad_ids.get(name)
            fields.append([counts[peer],
                           (BAD_ID if bad is not None else 0) | (OVERFLOWED if overflowed else 0),
                           0 if bad is None else bad])
    header = torch.tensor(fields, dtype=torch.long)  # one tensor, not one write per field
    moved = with_header(header, like.dtype).view(world, -1).to(like.device, non_blocking=True)
    return fields, moved


def _to_peer(peer: int, names: list[str], pieces: dict[str, tuple[Tensor, ...]],
             room_to: dict[str, list[int]], header: Tensor) -> list[Tensor]:
    """The message to ``peer``: its count message (`_headers`), then each table's ids padded
    to the room reserved for them (cut to it when they overflow)."""
    parts = [header]
    for name in names:
        ids, room = pieces[name][peer], room_to[name][peer]
        count = ids.numel()
        parts.append(ids if count == room else ids[:room])
        if count < room:
            parts.append(ids.new_zeros(room - count))
    return parts


def cut_rooms(chunks: Sequence[Tensor], names: list[str], room_from: dict[str, list[int]],
              recv_counts: dict[str, list[int]], *, header: int) -> dict[str, list[Tensor]]:
    """Per table, per peer, the ids that arrived in the reserved room (padding dropped);
    each peer's chunk opens with ``header`` values."""
    out: dict[str, list[Tensor]] = {n: [] for n in names}
    for peer, chunk in enumerate(chunks):
        offset = header
        for name in names:
            room = room_from[name][peer]
            out[name].append(chunk[offset:offset + min(room, recv_counts[name][peer])])
            offset += room
    return out


def merge_rest(first: list[Tensor], rest: Sequence[Tensor]) -> list[Tensor]:
    """Per peer, the ids that fit followed by those of the second all_to_all."""
    return [torch.cat([a, b]) for a, b in zip(first, rest, strict=True)]
