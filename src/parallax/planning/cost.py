"""Predicted inter-machine bytes per machine and iteration: the papers' Table 3, for our engine.

``W`` workers on ``N`` machines (``k = W / N`` each); a parameter of ``w`` bytes in rows of
``r`` bytes; ``U = α w / r`` the rows one worker uses per step (``U_m`` for the union over one
machine's workers); ids are 8 bytes. Bytes sent plus received across machines, averaged over
machines (a dense parameter on a PS loads its own server's machine most: Table 3's hot spot):

| parameter | architecture | bytes per machine and step |
|---|---|---|
| dense | AllReduce (ring over the N machines' leaders) | ``4 w (N-1) / N`` |
| dense, small (CPU) | AllReduce by one all_to_all (`allreduce_dense`) | ``2 k (W-k) w`` |
| dense, ``dense_sync="flat"`` | one ring over all ``W`` ranks (DDP's default) | ``4 w (W-1) / W`` |
| sparse | PS | ``2 k U (N-1)/N (8 + 2r)``: ids out, rows back, gradient rows out |
| sparse | PS + local aggregation | ``2 U_m (N-1)/N (8 + 2r)``: one sender per machine |
| dense | PS (whole on one server) | as sparse PS with ``U = w / r`` (every row, every step) |
| sparse | AllGatherv | ``2 k (W-k) U (8 + r)``: every worker's (ids, rows) to every other |
| bags | pooled on one owner | ``2 k (N-1)/N (8 (L + B) + 2 B r)`` for ``L`` ids in ``B`` bags |

plus the count messages that open each exchange (24 bytes to every rank, both ways), which
matter for small tables. With one worker per machine these are Table 3's ``4w(N-1)/N``,
``4αw(N-1)/N`` (+ index bytes) and ``2αw(N-1)``.
"""

from __future__ import annotations

from dataclasses import dataclass

from parallax.engine.tables import reduction
from parallax.engine.tables.exchange import COUNT_MESSAGE_BYTES

ID_BYTES = 4  # pulled and pooled ids travel as int32 (`exchange.wire_id_dtype`)
REPLICA_ID_BYTES = 8  # the allgatherv's ids, int64
POOLED_HEADER_BYTES = 5 * 8  # `parallax.engine.tables.pooled`'s header, to every rank


@dataclass(frozen=True)
class Shape:
    """The cluster as the cost model sees it."""

    machines: int
    workers_per_machine: int
    #: small AllReduce payloads go by one all_to_all (`parallax.engine.tables.reduction.small`: a
    #: run on CPU over gloo); False: every AllReduce is a ring, as in the papers
    small_sums: bool = False
    #: the dense parameters' gradients go by one ring over every rank (`Config.dense_sync`
    #: ``"flat"``), not machine by machine; a replicated table's sum is machine by machine
    #: either way (`parallax.engine.tables.reduction`)
    flat_dense: bool = False

    @property
    def world(self) -> int:
        return self.machines * self.workers_per_machine


def count_messages(shape: Shape, exchanges: int) -> float:
    """Bytes of ``exchanges`` count messages crossing machines, per machine."""
    k = shape.workers_per_machine
    return exchanges * 2 * COUNT_MESSAGE_BYTES * k * (shape.world - k)


def allreduce_dense(w: float, shape: Shape, *, payload: float | None = None,
                    flat: bool = False) -> float:
    """`parallax.engine.tables.reduction.all_reduce` of ``w`` bytes within a sum of ``payload``
    bytes (default: ``w`` alone): reduced inside machines and a ring among machines, or, for
    a small payload under ``shape.small_sums``, one all_to_all in which each of a machine's
    ``k`` workers sends ``w`` to the ``W - k`` workers of other machines and receives as
    much. ``flat``: one ring over all ``W`` ranks instead (`Config.dense_sync` ``"flat"``,
    whatever the size): a machine's ranks are consecutive in the ring, so it leaves and
    enters each machine once, each time with ``2 w (W-1) / W``."""
    k = shape.workers_per_machine
    if flat:
        return 0.0 if shape.machines == 1 else 4 * w * (shape.world - 1) / shape.world
    if shape.small_sums and reduction.small(w if payload is None else payload, shape.world):
        return 2 * k * (shape.world - k) * w
    n = shape.machines
    return 4 * w * (n - 1) / n


def ps_rows(rows: float, row_bytes: float, shape: Shape, *, local_aggregation: bool) -> float:
    """Pull and push of ``rows`` rows per sender (a worker, or a machine when aggregating;
    with one worker per machine there is no leader hop: `ShardedTable`)."""
    n = shape.machines
    if n == 1:
        return 0.0
    aggregating = local_aggregation and shape.workers_per_machine > 1
    senders = 1 if aggregating else shape.workers_per_machine
    exchanges = 2 if aggregating else 1
    traffic = 2 * senders * rows * (n - 1) / n * (ID_BYTES + 2 * row_bytes)
    return traffic + count_messages(shape, exchanges)


def pooled_bags(ids: float, bags: float, row_bytes: float, shape: Shape, *,
                owners: int = 1, by_columns: bool = False) -> float:
    """Owner-side pooling (`parallax.engine.tables.pooled`) of ``bags`` bags of ``ids`` ids
    in all per worker and step: every worker sends its ids and one offset per bag and owner,
    gets one pooled row per bag and owner and sends its gradient back, plus the header every
    call sends to every rank. ``owners``: 1 for a table held whole (averaged over machines as
    the PS rows are: the owner's machine carries all of it, a hot spot); the servers' count
    for a table pooled by rows, each owner its rows' share of every bag (a worker's ids are
    split among them, the offsets and pooled rows go to and from each); ``by_columns``: the
    owners hold column slices (`Config.pooled_by_columns`): each gets every id and offset,
    and the pooled rows' slices add up to one row per bag."""
    n = shape.machines
    if n == 1:
        return 0.0
    k = shape.workers_per_machine
    remote = owners * (n - 1) / n  # owners off a worker's machine, on average
    ids_remote, rows_remote = (remote, (n - 1) / n) if by_columns else ((n - 1) / n, remote)
    traffic = 2 * k * (ID_BYTES * (ids * ids_remote + bags * remote)
                       + 2 * bags * row_bytes * rows_remote)
    return traffic + count_messages(shape, 1) * POOLED_HEADER_BYTES / COUNT_MESSAGE_BYTES


def allgatherv_rows(rows: float, row_bytes: float, shape: Shape) -> float:
    k = shape.workers_per_machine
    traffic = 2 * k * (shape.world - k) * rows * (REPLICA_ID_BYTES + row_bytes)
    return traffic + count_messages(shape, 2)
