"""Owner-side pooling: an ``nn.EmbeddingBag``'s bags pooled where its table lives.

The row path (`parallax.engine.tables.row_exchange.pull`) brings every row a bag reads to the
worker and sends every such row's gradient back. A table named in `Config.pooled_tables` is
held whole by one server (TorchRec's table-wise sharding) and its bags are pooled *there*:
each worker sends the owner its ids and offsets (and per-sample weights), the owner runs
``F.embedding_bag`` on its rows exactly as the worker's layer would, and sends back one pooled
vector per bag; after the backward each worker sends those vectors' gradients to the owner,
which runs the backward of its ``embedding_bag`` and adds the rows' gradients into its shard's
gradient like any pushed rows (averaged, clipped and updated by the servers' optimizer as
before). A bag of L ids costs one vector each way instead of up to L rows: the win of long bags
over big tables (a user's history); one-id bags gain nothing.

A table named in `Config.pooled_by_rows` (TorchRec's row-wise sharding) keeps its rows
partitioned over the servers: each worker sends every server the ids of its rows with each
bag's start among them (`Pooling.shares` of its sharding,
`parallax.engine.tables.sharding`), each server pools its share of every bag as a sum, and the
worker adds the shares in rank order, dividing by the bag's size under ``mean``
(`Pooling.added`);
the shares' gradients go back to each server. One table's pooling is spread over the servers,
for one pooled vector per server and bag; the result differs from one device only in the order
of a bag's sums. ``max`` is refused (a share's sum is no max).

A table named in `Config.pooled_by_columns` (TorchRec's column-wise sharding) is held as K
column slices, slice k on its own server: the engine sees the ``R x d`` table as the
``R*K x d/K`` table that views the same memory (row ``r*K + k`` of it is slice k of row r), in
K partitions by ``id % K`` (partition k is slice k), so the servers, their optimizer (any that
updates element by element), the gradients and the checkpoints need nothing new. Every owner
gets every id of every bag and pools its slice over the bag's whole id list with the worker's
own mode (``max`` and per-sample weights too); the worker puts the K slices side by side. Each
slice is pooled as one device pools those columns: exact. One big table's pooling, memory and
update are spread over K servers for the price of sending the ids K times (the pooled rows
move d numbers a bag, as with one owner). How each kind splits and joins a call is its
sharding's (`parallax.engine.tables.sharding.Pooling`); this module is the exchange.

Exact: the owner computes what the layer computes on one device, every worker's bags of a
call in one ``embedding_bag`` (each bag with its worker's ids, offsets, ``mode``,
``padding_idx`` and weights), on the rows of the unique ids of all workers together: the
global batch's call, so its backward is the single-device gradient of the rows. What
depends on the whole batch (``max_norm``, ``scale_grad_by_freq``) and per-sample weights
that require a gradient are not pooled (refused where the table is pinned, see
`parallax.planning.architectures`).

All the bag calls of a forward that the id program (`parallax.model.lookahead`) computes from
the inputs are pooled in one exchange before it (`pool_ahead`), all tables and owners
together, and served to the layers in order; any other call is an exchange of its own
(`pool_many` of one call). An exchange is collective: a header (counts and flags, to every
rank, so a bad id or refused weights fail every rank alike), the ids and offsets to the
owners (in one all_to_all with the header where the rooms reserved hold them, ids as int32
where the table fits), the weights if any rank has some, the pooled rows back: two
all_to_alls (three with weights); and one with all its gradients in the push.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from parallax.cluster import WorkerInfo
from parallax.engine.tables.bags import BagShare, bag_of_ids, bag_sizes
from parallax.engine.tables.exchange import (
    Hop,
    Traffic,
    all_to_all,
    header_of,
    wire_id_dtype,
    with_header,
)
from parallax.engine.tables.partitioning import RowPartitioning
from parallax.engine.tables.reservations import Reservations, cut_rooms, merge_rest
from parallax.engine.tables.riders import Rider, alight, board
from parallax.engine.tables.sharding import Sharding
from parallax.engine.tables.step_context import TableSteps, shared_steps
from parallax.errors import (
    ArgumentError,
    ArgumentTypeError,
    InternalError,
    SparseIdError,
    UnsupportedProgramError,
)

__all__ = ["BagCall", "PoolingTable", "PooledExchange", "bag_call", "bound_of_exchanges",
           "owners_of", "pending_exchanges", "pool_ahead", "pool_many", "push_pooled",
           "serve_ahead"]

# header flags, per sender and call
_BAD_ID = 1
_HAS_WEIGHTS = 2
_WEIGHTS_NEED_GRAD = 4
_REFUSED = 8  # a call torch refuses on one device (`_refusal`)
_OVERFLOWED = 16  # the sender's offsets and ids did not all fit the rooms reserved
# header fields, per sender, receiver and call: ids, offsets, flags, bad id, bags
_IDS, _OFFSETS, _FLAGS, _BAD, _BAGS = range(5)
_FIELDS = 5
HEADER_BYTES = _FIELDS * 8


class PoolingTable(Protocol):
    """What pooling needs of a server-held table
    (`parallax.engine.tables.server_table.ShardedTable` is one)."""

    name: str
    num_rows: int
    dtype: torch.dtype
    device: torch.device
    worker: WorkerInfo
    group: dist.ProcessGroup
    traffic: Traffic
    partitioning: RowPartitioning
    #: how it pools (`parallax.engine.tables.sharding`): by its rows, every server its share;
    #: or as column slices, each on its server; or whole on one owner
    sharding: Sharding
    average: bool
    divides_rows_on_arrival: bool
    has_gradient: bool
    rows_used: list[int]
    measuring: bool
    #: the run's step: the exchanges owed and the bags pooled ahead live there
    steps: TableSteps
    #: the rooms `pool_many` reserves for each call's offsets and ids, per exchange key
    pooled_reservations: dict[str, Reservations]
    before_read: Callable[[Tensor | None], None] | None

    @property
    def sums_as_rows_arrive(self) -> bool: ...

    def server_shard(self) -> nn.Parameter: ...

    def empty_rows(self, count: int) -> Tensor: ...

    def accumulate(self, local_rows: Tensor, grad_rows: Tensor,
                   touched: Tensor | None = None) -> None: ...


@dataclass
class BagCall:
    """One ``nn.EmbeddingBag`` call of a pooled table, as 1-D ids with offsets
    (`bag_call`)."""

    table: PoolingTable
    ids: Tensor
    offsets: Tensor
    weights: Tensor | None
    mode: str
    padding_idx: int | None
    include_last_offset: bool

    @property
    def bags(self) -> int:
        return max(self.offsets.numel() - int(self.include_last_offset), 0)

    @property
    def starts(self) -> Tensor:
        """Each bag's first id: torch's CPU kernel ends the last bag at the ids' end whatever
        the last offset says under ``include_last_offset`` (torch documents that offset as
        the ids' count; the CUDA kernel is not checked here, the GPU path's issue)."""
        return self.offsets[:-1] if self.include_last_offset else self.offsets

    def same_as(self, other: BagCall) -> bool:
        """Whether ``other`` is this very call (what serving a call pooled ahead checks)."""
        return (self.table is other.table and self.mode == other.mode
                and self.padding_idx == other.padding_idx
                and self.include_last_offset == other.include_last_offset
                and _equal(self.ids, other.ids) and _equal(self.offsets, other.offsets)
                and _equal(self.weights, other.weights))


def _equal(a: Tensor | None, b: Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def bag_call(table: PoolingTable, ids: Tensor, offsets: Tensor | None,
             per_sample_weights: Tensor | None, *, mode: str, padding_idx: int | None,
             include_last_offset: bool) -> BagCall:
    """The call ``F.embedding_bag(ids, table, offsets, ...)`` as 1-D ids with offsets, as
    ``F.embedding_bag`` itself turns a 2-D batch of fixed-length bags into one (same checks,
    same messages: raised here, on the rank that made the call, before any exchange)."""
    name, rank = table.name, table.worker.rank
    table.sharding.check_mode(name, rank, mode)
    if ids.dtype not in (torch.int64, torch.int32):
        raise ArgumentTypeError(f"parameter '{name}' on rank {rank}: ids must be an integer "
                                f"tensor, got {ids.dtype}")
    weights = per_sample_weights
    if weights is not None and weights.dtype != table.dtype:
        raise ArgumentTypeError(f"parameter '{name}' on rank {rank}: per_sample_weights must "
                                f"have the table's dtype {table.dtype}, got {weights.dtype} "
                                f"(torch refuses it on one device)")
    if weights is not None and weights.shape != ids.shape:
        raise ArgumentError(f"embedding_bag: If per_sample_weights ({weights.shape}) is not "
                            f"None, then it must have the same shape as the input "
                            f"({ids.shape})")
    if ids.dim() == 2:
        if offsets is not None:
            raise ArgumentError("if input is 2D, then offsets has to be None, as input is "
                                "treated is a mini-batch of fixed length sequences. However, "
                                f"found offsets of type {type(offsets)}")
        offsets = torch.arange(0, ids.numel(), ids.size(1), dtype=ids.dtype, device=ids.device)
        ids, include_last_offset = ids.reshape(-1), False
        weights = None if weights is None else weights.reshape(-1)
    elif ids.dim() != 1:
        raise ArgumentError(f"input has to be 1D or 2D Tensor, but got Tensor of dimension "
                            f"{ids.dim()}")
    elif offsets is None or offsets.dim() != 1:
        raise ArgumentError("offsets has to be a 1D Tensor"
                            + (" but got None" if offsets is None else ""))
    return BagCall(table, ids, offsets, weights, mode, padding_idx, include_last_offset)


def owners_of(table: PoolingTable) -> list[int]:
    """The ranks that pool a table's bags, in rank order (its sharding's `owners`: the one
    server holding it whole, every server holding some of its rows, or each column slice's
    server)."""
    return table.sharding.owners(table.partitioning)


def model_rows(table: PoolingTable) -> int:
    """The rows of the program's table (a table pooled by columns is held as
    ``rows * sharding.slices`` rows of its slices)."""
    return table.num_rows // table.sharding.slices


@dataclass
class _Owned:
    """At the owner, one call of every worker, pooled in one ``embedding_bag``."""

    pooled: Tensor         # every worker's pooled rows, in worker order
    bags: list[int]        # how many of them are each worker's
    local_rows: Tensor     # where the unique ids' rows are in the shard
    #: the unique rows' gradient for the pooled rows' gradient (None: no row has one)
    backward: Callable[[Tensor], Tensor | None]
    #: sum and mean: each id's gradient, with its position among the unique ids, for a
    #: shard that adds rows as they arrive (`_Merged.per_id_gradient`; None: ``max``)
    per_id: Callable[[Tensor], tuple[Tensor, Tensor] | None] | None = None


@dataclass
class PooledExchange:
    """The pooled calls of one exchange, kept until their gradients are pushed (in one
    message, against the exchange's last hop)."""

    calls: list[BagCall]
    outs: list[Tensor]           # this rank's pooled rows per call (leaves: .grad is pushed)
    keys: list[str]
    hop: Hop                     # owners -> workers; its backward carries the gradients
    owned: dict[int, _Owned] = field(default_factory=dict)  # at owners, by call index


def pool_ahead(calls: Sequence[BagCall]) -> None:
    """Pool ``calls`` (a forward's, computed ahead) in one exchange; each table then serves
    its layers' calls in order (`serve_ahead`)."""
    if not calls:
        return
    ahead = shared_steps([call.table for call in calls]).current.pooled_ahead
    for call, out in zip(calls, pool_many(calls), strict=True):
        ahead.setdefault(call.table.name, []).append((call, out))


def rows_ahead_call(table: PoolingTable, ids: Tensor) -> BagCall:
    """The call that pools ahead the rows an ``nn.Embedding`` or a gather of ``table`` looks
    up for ``ids`` (batch x bag): their sums over each row of ids. Which reduction the
    program applies is known only when it applies it (`parallax.model.bag_reductions`): a
    mean is the sum divided by the bag's length there (`rows_reduced`)."""
    return bag_call(table, ids, None, None, mode="sum", padding_idx=None,
                    include_last_offset=False)


def rows_reduced(summed: Tensor, mode: str, bag_length: int) -> Tensor:
    """The ``mode`` ("sum" or "mean") of looked-up rows over each bag of ``bag_length`` ids,
    from their ``summed`` rows pooled ahead: a new tensor (the same rows may be reduced
    again), the mean as torch averages, the sum divided by the length."""
    return summed.clone() if mode == "sum" else summed / bag_length


def serve_ahead(call: BagCall) -> Tensor:
    """The pooled rows of ``call``, pooled ahead for this forward."""
    table = call.table
    ahead, out = table.steps.current.pooled_ahead[table.name].pop(0)
    if not ahead.same_as(call):
        raise InternalError(
            f"parallax internal error: rank {table.worker.rank} made a call of '{table.name}' "
            f"other than the one pooled ahead for it; please report it")
    return out


def pool_many(calls: Sequence[BagCall]) -> list[Tensor]:
    """This rank's pooled rows of every call, computed on the calls' owners in one exchange
    (collective: every rank passes the same tables' calls in the same order)."""
    first = calls[0].table
    rank, world = first.worker.rank, first.worker.world_size
    owners = [owners_of(call.table) for call in calls]
    refused = [_refusal(call) is not None for call in calls]
    shares = [call.table.sharding.shares(call, mine, no)
              for call, mine, no in zip(calls, owners, refused, strict=True)]
    keys = [f"{call.table.name}#{i}" for i, call in enumerate(calls)]
    accounts = {key: call.table.name for key, call in zip(keys, calls, strict=True)}
    header, received = _open(calls, shares, refused, keys)
    weights = _send_weights(calls, shares, header, keys, accounts)
    grad = torch.is_grad_enabled()
    owned = {i: _pool_at_owner(call, header[:, i], received[keys[i]], weights.get(keys[i]),
                               grad=grad)
             for i, call in enumerate(calls) if rank in owners[i]}
    payloads = {k: owned[i].pooled.detach() if i in owned else c.table.empty_rows(0)
                for i, (k, c) in enumerate(zip(keys, calls, strict=True))}
    sends = {k: header[:, i, _BAGS].tolist() if rank in owners[i] else [0] * world
             for i, k in enumerate(keys)}
    receives = {k: [c.bags if peer in owners[i] else 0 for peer in range(world)]
                for i, (k, c) in enumerate(zip(keys, calls, strict=True))}
    hop = Hop(sends, receives, first.group, first.traffic, accounts)
    outs = hop.forward_many(payloads)
    leaves = [outs[k] for k in keys]  # the owners' shares: their gradients are pushed
    if grad:
        for leaf in leaves:
            leaf.requires_grad_(True)
    result = [call.table.sharding.added(call, leaf, mine)
              for call, leaf, mine in zip(calls, leaves, owners, strict=True)]
    if grad:
        shared_steps([call.table for call in calls]).current.pooled.append(
            PooledExchange(list(calls), leaves, keys, hop, owned))
    return result


def _open(calls: Sequence[BagCall], shares: list[dict[int, BagShare]], refused: list[bool],
          keys: list[str]) -> tuple[Tensor, dict[str, Tensor]]:
    """The header (every sender's counts to each of a call's owners and flags to every rank,
    as ``[sender, call, field]``) and, at the owners, every sender's share of each call
    (``key``: bag starts, then ids), in one all_to_all where the rooms reserved hold them
    (`parallax.engine.tables.reservations`: the most sent over the last exchanges of the same
    calls; a second all_to_all only when some rank overflowed, which every header says).
    Raises on every rank alike for a bad id, weights that need a gradient or a call torch
    refuses, naming the rank."""
    first = calls[0].table
    world = first.worker.world_size
    wire = wire_id_dtype([c.table.num_rows for c in calls])
    rooms = [first.pooled_reservations.setdefault(key, Reservations(world)) for key in keys]
    empty = torch.empty(0, dtype=wire, device=first.device)
    payloads = [[empty] * world for _ in keys]
    for payload, mine in zip(payloads, shares, strict=True):
        for owner, share in mine.items():
            payload[owner] = torch.cat([share.starts.to(wire), share.ids.to(wire)]).to(
                first.device)
    sends = {k: [p.numel() for p in payload] for k, payload in zip(keys, payloads, strict=True)}
    room_to = {k: room.rooms_to() for k, room in zip(keys, rooms, strict=True)}
    room_from = {k: room.rooms_from() for k, room in zip(keys, rooms, strict=True)}
    overflowed = any(sends[k][p] > room_to[k][p] for k in keys for p in range(world))
    header = _header(calls, shares, refused, overflowed)
    fields = len(calls) * _FIELDS * 8 // wire.itemsize  # the header's values, as ``wire``
    headers = header.to(first.device, non_blocking=True)  # one copy, without a wait
    parts = []
    for peer in range(world):
        parts.append(with_header(headers[peer], wire))
        for key, payload in zip(keys, payloads, strict=True):
            sent = payload[peer][:room_to[key][peer]]
            parts += [sent, sent.new_zeros(room_to[key][peer] - sent.numel())]
    send_splits = [fields + sum(room_to[k][p] for k in keys) for p in range(world)]
    recv_splits = [fields + sum(room_from[k][p] for k in keys) for p in range(world)]
    message = torch.cat(parts)
    out = message.new_empty(sum(recv_splits))
    all_to_all(out, message, recv_splits, send_splits, group=first.group)
    chunks = out.split_with_sizes(recv_splits)
    received = header_of(chunks, len(calls) * _FIELDS).view(world, len(calls), _FIELDS)
    _record_open(calls, keys, room_to, room_from, wire.itemsize)
    _raise_flagged(calls, received)
    counts = {k: (received[:, i, _IDS] + received[:, i, _OFFSETS]).tolist()
              for i, k in enumerate(keys)}
    pieces = cut_rooms(chunks, keys, room_from, counts, header=fields)
    if bool((received[:, :, _FLAGS] & _OVERFLOWED).any()):
        rest = Hop({k: [max(0, c - r) for c, r in zip(sends[k], room_to[k], strict=True)]
                    for k in keys},
                   {k: [max(0, c - r) for c, r in zip(counts[k], room_from[k], strict=True)]
                    for k in keys}, first.group, first.traffic,
                   {k: c.table.name for k, c in zip(keys, calls, strict=True)})
        more = rest.forward_many({k: torch.cat([part[room_to[k][p]:]
                                                for p, part in enumerate(payload)])
                                  for k, payload in zip(keys, payloads, strict=True)})
        pieces = {k: merge_rest(pieces[k], more[k].split(rest.recv_counts[k])) for k in keys}
    for key, reserved in zip(keys, rooms, strict=True):
        reserved.note(sends[key], counts[key])
    return received, {k: torch.cat(pieces[k]) for k in keys}  # (as sent: int32 where it fits)


def _header(calls: Sequence[BagCall], shares: list[dict[int, BagShare]], refused: list[bool],
            overflowed: bool) -> Tensor:
    """This rank's header to every peer, ``[peer, call, field]``: counts to each of a call's
    owners, flags and bad ids to every rank."""
    world = calls[0].table.worker.world_size
    # built as lists, made a tensor once: an element assignment into a tensor costs a few
    # microseconds each, and a step's header took some thirty
    message = [[[0] * _FIELDS for _ in calls] for _ in range(world)]
    for i, (call, mine, no) in enumerate(zip(calls, shares, refused, strict=True)):
        flags, bad = _OVERFLOWED if overflowed else 0, 0
        if call.ids.numel():
            low, high = (int(v) for v in torch.aminmax(call.ids))
            if low < 0 or high >= model_rows(call.table):
                flags, bad = flags | _BAD_ID, low if low < 0 else high
        if call.weights is not None:
            flags |= _HAS_WEIGHTS | (_WEIGHTS_NEED_GRAD if call.weights.requires_grad else 0)
        flags |= _REFUSED if no else 0
        for peer in range(world):
            message[peer][i][_FLAGS], message[peer][i][_BAD] = flags, bad
        for owner, share in mine.items():
            fields = message[owner][i]
            fields[_IDS], fields[_OFFSETS] = share.ids.numel(), share.starts.numel()
            fields[_BAGS] = call.bags
    return torch.tensor(message, dtype=torch.long)


def _record_open(calls: Sequence[BagCall], keys: list[str], room_to: dict[str, list[int]],
                 room_from: dict[str, list[int]], id_bytes: int) -> None:
    """The opening message's bytes, per table: its header to every rank, the rooms."""
    first = calls[0].table
    world = first.worker.world_size
    for call in {c.table.name: c for c in calls}.values():
        first.traffic.record(call.table.name, [1] * world, [1] * world,
                             HEADER_BYTES * sum(c.table is call.table for c in calls))
    for key, call in zip(keys, calls, strict=True):
        first.traffic.record(call.table.name, room_to[key], room_from[key], id_bytes)


def _raise_flagged(calls: Sequence[BagCall], received: Tensor) -> None:
    """Raise, on every rank alike, what any sender's header flags (``[sender, call, field]``)."""
    if not bool((received[:, :, _FLAGS] & (_REFUSED | _BAD_ID | _WEIGHTS_NEED_GRAD)).any()):
        return  # (the common case, in one operator rather than three per call)
    first = calls[0].table
    for i, call in enumerate(calls):
        sender_flags = received[:, i, _FLAGS]
        for peer in (sender_flags & _REFUSED).nonzero().flatten().tolist():
            mine = _refusal(call) if peer == first.worker.rank else None
            raise ArgumentError(
                f"rank {peer}: the call of '{call.table.name}''s nn.EmbeddingBag is one torch "
                f"refuses on one device: " + (mine or f"see rank {peer}'s error"))
        for peer in (sender_flags & _BAD_ID).nonzero().flatten().tolist():
            machine = first.traffic.machine_of_rank[peer]
            raise SparseIdError(f"parallax: sparse parameter '{call.table.name}' got id "
                                f"{int(received[peer, i, _BAD])} on rank {peer} (machine "
                                f"{machine}), outside its rows [0, {model_rows(call.table)})")
        for peer in (sender_flags & _WEIGHTS_NEED_GRAD).nonzero().flatten().tolist():
            raise UnsupportedProgramError(
                f"rank {peer}: parameter '{call.table.name}' is pooled on its owner "
                "(Config.pooled_tables), but its per_sample_weights require a gradient, which "
                "owner-side pooling does not send back; leave the table out of pooled_tables "
                "(its rows are then pulled to the workers) or detach the weights")


def _refusal(call: BagCall) -> str | None:
    """What torch says of a call it refuses for its values (its offsets, its weights' mode),
    found before the exchange so that every rank fails alike; None for a valid call."""
    offsets, count = call.offsets, call.ids.numel()
    if call.weights is not None and call.mode != "sum":
        return (f"embedding_bag: per_sample_weights was not None. per_sample_weights is only "
                f"supported for mode='sum' (got mode='{call.mode}')")
    if call.include_last_offset and offsets.numel() == 0:
        return "include_last_offset: number of offset should be at least 1"
    if count and not call.bags:
        return (f"{count} ids but no bags (offsets {offsets.tolist()}"
                f"{', include_last_offset' if call.include_last_offset else ''}): torch "
                f"{torch.__version__}'s embedding_bag crashes on such a call (SIGSEGV)")
    if offsets.numel() and int(offsets[0]) != 0:
        return ("offsets[0] has to be 0, i.e., the first sequence in the mini-batch has to "
                "start from position 0")
    if offsets.numel() and int(offsets[-1]) > count:
        return (f"offsets[-1] can not be greater than input's length {count} but got "
                f"offsets[-1] of {int(offsets[-1])}")
    if offsets.numel() > 1 and bool((offsets[1:] < offsets[:-1]).any()):
        return "offsets must not decrease"
    return None


def _send_weights(calls: Sequence[BagCall], shares: list[dict[int, BagShare]], header: Tensor,
                  keys: list[str], accounts: dict[str, str]) -> dict[str, Tensor]:
    """The per-sample weights of the calls for which any rank has some, at their owners (each
    owner the weights of its share of the ids)."""
    weighted = [i for i in range(len(calls)) if bool((header[:, i, _FLAGS] & _HAS_WEIGHTS)
                                                     .any())]
    if not weighted:
        return {}
    first = calls[0].table
    world = first.worker.world_size
    mine, send = {}, {}
    for i in weighted:
        parts = {owner: _weights_of(calls[i], share) for owner, share in shares[i].items()}
        mine[keys[i]] = torch.cat([parts[owner] for owner in sorted(parts)])
        send[keys[i]] = [parts[peer].numel() if peer in parts else 0 for peer in range(world)]
    receive = {keys[i]: [int(n) for n in header[:, i, _IDS] * ((header[:, i, _FLAGS]
                                                               & _HAS_WEIGHTS) > 0)]
               for i in weighted}
    return Hop(send, receive, first.group, first.traffic, accounts).forward_many(mine)


def _weights_of(call: BagCall, share: BagShare) -> Tensor:
    """A share's weights as sent (an empty tensor of the table's dtype for none)."""
    if share.weights is None:
        return call.table.empty_rows(0).new_empty(0)
    return share.weights.detach()


def _pool_at_owner(call: BagCall, header: Tensor, received: Tensor, weights: Tensor | None,
                   *, grad: bool) -> _Owned:
    """Every worker's ``call`` computed on the unique rows of all of them, in one
    ``embedding_bag`` whose bags are every worker's in worker order: each bag is pooled as
    the worker's own call pools it (the same ids, weights and mode, in the same order), and
    the rows' gradient is the backward of the global batch's call, as on one device
    (`_Merged.rows_gradient`; torch's own backward under ``max``, with the graph kept when
    ``grad``). ``header``: this call's ``[sender, field]``."""
    table = call.table
    counts = header[:, _IDS].tolist()
    sizes = header[:, _OFFSETS].tolist()
    pieces = received.split([n + m for n, m in zip(counts, sizes, strict=True)])
    # (the ids as they came: int32 where the table fits sorts in 2/3 of int64's time)
    unique, inverse = torch.unique(torch.cat([p[m:] for p, m in zip(pieces, sizes, strict=True)]),
                                   return_inverse=True)
    unique = unique.long()
    sharding = table.sharding
    column = sharding.column(table.partitioning, table.worker.rank)
    local = table.partitioning.local_row(unique * sharding.slices + column)  # (its slice's row)
    if table.before_read is not None:
        table.before_read(local)  # deferred steps first (values and optimizer state)
    rows = table.server_shard().detach().index_select(0, local)
    padding = None
    if call.padding_idx is not None:
        target = call.padding_idx % model_rows(table)
        hits = (unique == target).nonzero()
        padding = int(hits[0, 0]) if hits.numel() else None
    has_weights = ((header[:, _FLAGS] & _HAS_WEIGHTS) > 0).tolist()
    sent_weights = (list(weights.split([n if h else 0 for n, h in zip(counts, has_weights,
                                                                       strict=True)]))
                    if weights is not None else None)
    offsets, weight_parts, bags = [], [], []
    start = 0
    for w, (piece, m, n) in enumerate(zip(pieces, sizes, counts, strict=True)):
        offsets.append(piece[:m] + start)  # each worker's bag starts, past the ids before
        bags.append(m)
        start += n
        if sent_weights is not None:  # a worker without weights weighs each id 1, exactly
            weight_parts.append(sent_weights[w] if has_weights[w] else rows.new_ones(n))
    mode = sharding.owner_mode(call.mode, len(owners_of(table)))
    merged = _Merged(inverse, torch.cat(offsets).long(),
                     torch.cat(weight_parts) if weight_parts else None, padding, mode)
    if mode == "max":  # the gradient goes to each bag's largest: torch's backward finds it
        if grad:
            rows.requires_grad_(True)
        pooled = merged.pool(rows)
        return _Owned(pooled, bags, local, _autograd_backward(pooled, rows))
    with torch.no_grad():
        pooled = merged.pool(rows)
    return _Owned(pooled, bags, local, partial(merged.rows_gradient, rows),
                  merged.per_id_gradient)


@dataclass
class _Merged:
    """Every worker's bags of one call as one ``embedding_bag`` over the unique rows: each id
    a position among them, the bags' starts, the weights (or None), the padding position."""

    ids: Tensor
    offsets: Tensor
    weights: Tensor | None
    padding: int | None
    mode: str

    def pool(self, rows: Tensor) -> Tensor:
        return F.embedding_bag(self.ids, rows, self.offsets, mode=self.mode,
                               per_sample_weights=self.weights, padding_idx=self.padding)

    def rows_gradient(self, rows: Tensor, grads: Tensor) -> Tensor | None:
        """The rows' gradient of a sum or mean for the bags' gradient ``grads``: each id
        adds its bag's gradient (times its weight; divided by the bag's count of ids other
        than the padding under ``mean``) to its row, as torch's backward does. Written out:
        torch's ``embedding_bag`` backward over many unique rows costs several times the
        forward."""
        found = self.per_id_gradient(grads)
        if found is None:
            return None
        ids, per_id = found
        return torch.zeros_like(rows).index_add_(0, ids, per_id)

    def per_id_gradient(self, grads: Tensor) -> tuple[Tensor, Tensor] | None:
        """`rows_gradient` before its sum: each id's position among the unique rows and its
        gradient (the padding's left out); None without ids."""
        if not self.ids.numel():
            return None
        bag = bag_of_ids(self.offsets, self.ids.numel())
        kept = None if self.padding is None else self.ids != self.padding
        if self.mode == "mean" and self.weights is None:  # (torch allows weights with sum only)
            # each bag's gradient divided once, not once per id: the same quotients
            sizes = bag_sizes(bag, kept, self.offsets.numel())
            grads = grads / sizes.unsqueeze(1).to(grads.dtype)
        # (index_select: a gather of rows; ``grads[bag]`` is several times slower on the CPU)
        ids, per_id = self.ids, grads.index_select(0, bag)
        if self.weights is not None:
            per_id = per_id * self.weights.unsqueeze(1)
            if self.mode == "mean":
                sizes = bag_sizes(bag, kept, self.offsets.numel())
                per_id = per_id / sizes[bag].unsqueeze(1).to(per_id.dtype)
        if kept is not None:
            ids, per_id = ids[kept], per_id[kept]
        return ids, per_id


def _autograd_backward(pooled: Tensor, rows: Tensor) -> Callable[[Tensor], Tensor | None]:
    def backward(grads: Tensor) -> Tensor | None:
        if not pooled.requires_grad:
            return None
        pooled.backward(grads)
        return rows.grad
    return backward


def pending_exchanges(tables: Sequence[PoolingTable]) -> list[PooledExchange]:
    """This step's pooled exchanges not yet pushed, in the order `push_pooled` sends them
    (the same on every rank); records each table's use (`has_gradient`, `rows_used`)."""
    if not tables:
        return []
    owed: list[PooledExchange] = tables[0].steps.current.pooled
    if not owed:
        return []
    ids = {id(table) for table in tables}
    records = [record for record in owed if any(id(call.table) in ids for call in record.calls)]
    for table in tables:
        mine = [(call, out) for record in records
                for call, out in zip(record.calls, record.outs, strict=True)
                if call.table is table]
        if mine:
            table.has_gradient = table.has_gradient or any(o.grad is not None for _, o in mine)
            if table.measuring:  # (the rows of its slices, for a table held as such)
                table.rows_used.append(table.sharding.slices * sum(
                    int(torch.unique(c.ids).numel()) for c, _ in mine))
    return records  # (in call order: the same on all ranks)


def bound_of_exchanges(exchanges: Sequence[PooledExchange],
                       device: torch.device | None = None) -> Tensor:
    """A bound on what this rank's pooled gradients add to any element of an owner's
    aggregated gradient (`parallax.engine.tables.verdict`): a row's gradient from one call is
    a sum over the call's ids of a bag's gradient times its weight (divided by the bag's size
    under ``mean``), so at most ids x largest gradient x max(1, largest weight). Float64, on
    ``device`` (nothing read back: on a GPU each read-back is a wait)."""
    bound = torch.zeros((), dtype=torch.float64, device=device)
    for record in exchanges:
        for call, out in zip(record.calls, record.outs, strict=True):
            if out.grad is None or not out.grad.numel() or not call.ids.numel():
                continue
            top = out.grad.detach().abs().max().to(bound.device, torch.float64)
            if call.weights is not None and call.weights.numel():
                top = top * call.weights.detach().abs().max().to(
                    bound.device, torch.float64).clamp(min=1.0)
            bound = bound + top * call.ids.numel()
    return bound


def push_pooled(exchanges: Sequence[PooledExchange], riders: Sequence[Rider] = ()) -> None:
    """Send the gradients of ``exchanges`` (`pending_exchanges`) to the owners, one message
    per exchange, where they are added to the shards' gradients (collective: every rank's
    exchanges in the same order). ``riders``: those still waiting ride in the first message
    (`parallax.engine.tables.riders`)."""
    for record in exchanges:
        grads = {key: out.grad if out.grad is not None else torch.zeros_like(out)
                 for key, out in zip(record.keys, record.outs, strict=True)}
        hop, payloads = board(riders, record.hop, grads)
        received = alight(riders, hop.backward_many(payloads))
        for i, owned in record.owned.items():
            _backward_at_owner(record.calls[i], owned, received[record.keys[i]])


def _backward_at_owner(call: BagCall, owned: _Owned, grads: Tensor) -> None:
    """The rows' gradient of every worker's pooled rows' ``grads`` (in worker order), into the
    shard's: where the shard adds rows as they arrive, each id's gradient goes straight in
    (no buffer of the unique rows, no second sum: the history workload's owner spent ~3 %
    of its step there); else summed per unique row first."""
    table = call.table
    if owned.per_id is not None and table.sums_as_rows_arrive:
        # averaged per bag before each id takes its bag's gradient: one division a bag, not
        # one an id (the history workload's owner divided 32 ids' rows a bag)
        found = owned.per_id(grads / table.worker.world_size if table.divides_rows_on_arrival
                               else grads)
        if found is None:
            return
        positions, per_id = found
        table.accumulate(owned.local_rows[positions], per_id, touched=owned.local_rows)
        return
    rows_grad = owned.backward(grads)
    if rows_grad is None:
        return
    if table.divides_rows_on_arrival:
        rows_grad.div_(table.worker.world_size)
    table.accumulate(owned.local_rows, rows_grad)
