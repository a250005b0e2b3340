"""Riders: small per-rank payloads that travel in a message the push sends anyway, instead of
in a collective of their own.

A step's push is one all_to_all in which every rank sends to every rank (`Hop`), so whatever
every rank must tell every other rank once the backward is over can ride in it: one row per
peer, appended to the message (`Hop.carrying`), added up by each rank in rank order (the same
sum, bit for bit, everywhere). Three ride today: the step's verdict
(`parallax.engine.tables.verdict`) and, under `Runner.step`, small dense gradients
(`parallax.engine.dense_sync.deferred`) and the optimizers' settings' fingerprint
(`parallax.step.hyperparameters.SettingsRider`). A collective costs a few milliseconds of waiting on
this CPU cluster whatever its size (record small_sums-2x2-1gbit); a rider costs its bytes.

The first message the push sends takes every rider waiting; the riders no message took (a
step without a push message: no server-held table was used) are sent by `settle`, together
in one collective, so the result never depends on whether they rode.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, cast

import torch
import torch.distributed as dist
from torch import Tensor

from parallax.engine.tables.exchange import Hop, all_to_all

__all__ = ["Rider", "alight", "board", "rank_order_sum", "settle"]


class Rider(Protocol):
    """A payload for every peer (``waiting``: ``[world, n]``, one dtype) under a name of its
    own (``key``: not a parameter name), and what to do with every rank's (`receive`)."""

    key: str
    #: this rank's rows, until a message takes them
    waiting: Tensor | None

    def receive(self, received: Tensor) -> None:
        """Every rank's row (``[world, n]``, in rank order)."""


def board(riders: Sequence[Rider], hop: Hop, payloads: dict[str, Tensor],
          ) -> tuple[Hop, dict[str, Tensor]]:
    """``hop`` and ``payloads`` with every rider still waiting aboard (the first message a
    push sends takes them all); unchanged when none waits."""
    for rider in riders:
        if rider.waiting is not None:
            hop = hop.carrying(rider.key)
            payloads = {**payloads, rider.key: rider.waiting}
            rider.waiting = None
    return hop, payloads


def alight(riders: Sequence[Rider], received: dict[str, Tensor]) -> dict[str, Tensor]:
    """What a message brought, each rider that came with it taken out and received."""
    for rider in riders:
        came = received.pop(rider.key, None)
        if came is not None:
            rider.receive(came)
    return received


def settle(riders: Sequence[Rider], group: dist.ProcessGroup | None) -> None:
    """Send, in one all_to_all, the riders no message took (collective: every rank's riders
    wait alike, since the push's messages are the same on every rank): each rider's rows
    side by side, viewed as bytes where their dtypes differ."""
    waiting = [rider for rider in riders if rider.waiting is not None]
    if not waiting:
        return
    rows = [cast(Tensor, rider.waiting).contiguous() for rider in waiting]
    for rider in waiting:
        rider.waiting = None
    if len(rows) == 1 or all([row.dtype == rows[0].dtype for row in rows]):
        sent, widths = torch.cat(rows, dim=1) if len(rows) > 1 else rows[0], None
    else:
        as_bytes = [row.view(torch.uint8) for row in rows]
        sent, widths = torch.cat(as_bytes, dim=1), [row.shape[1] for row in as_bytes]
    received = sent.new_empty(sent.shape)
    all_to_all(received, sent, group=group)
    if widths is None:
        pieces = received.split_with_sizes([row.shape[1] for row in rows], dim=1)
    else:  # (each piece copied whole, so that its bytes start where its dtype's would)
        pieces = tuple(piece.contiguous().view(row.dtype) for piece, row in zip(
            received.split_with_sizes(widths, dim=1), rows, strict=True))
    for rider, piece in zip(waiting, pieces, strict=True):
        rider.receive(piece)


def rank_order_sum(received: Tensor) -> Tensor:
    """The rows of ``received`` added in rank order (elementwise, so every rank gets the same
    bits; a reduction over the first dimension may vectorise differently on another CPU)."""
    rows = received.unbind(0)  # (one op for every row, not a slice and an iteration)
    if len(rows) == 1:
        return rows[0].clone()
    total = rows[0] + rows[1]
    for row in rows[2:]:
        total += row
    return total
