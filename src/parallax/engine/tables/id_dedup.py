"""Which side deduplicates a step's ids of a server-held table (`Config.id_dedup`: seed 001's
operation placement between servers and workers, +OPSW).

A lookup reads rows by id, and ids repeat within a batch (Zipf-distributed words, popular
items). Deduplicating them, and summing the gradient rows of an id's repeats, is light work
whose output is smaller than its input, so it belongs on the side the data leaves from: the
workers (`Distinct`, the default), which then send each id once and receive and push one row
per distinct id. A placement that keeps the servers' side of the boundary for everything about
the table (`EveryLookup`, the ablation's baseline) sends every looked-up id, a row per lookup
back and a gradient row per lookup out; the servers' gather serves repeats and their
``index_add_`` sums them. Both give the same values (a row's repeats are summed in another
order: the same up to rounding). A machine's leader under local aggregation merges its
workers' ids either way: that merge is the local aggregation itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from torch import Tensor

from parallax.engine.tables.exchange import sorted_ids_many, unique_ids_many

__all__ = ["ID_DEDUP", "Distinct", "EveryLookup", "IdRequests"]


class IdRequests(Protocol):
    """What a pull sends for a step's ids of its tables (one per run: `Config.id_dedup`)."""

    #: whether the ids sent are distinct (a server's received rows then are too)
    distinct: bool

    def requests(self, ids: Sequence[Tensor], num_rows: Sequence[int], names: Sequence[str],
                 rank: int) -> list[tuple[Tensor, Tensor, int | None]]:
        """Per table ``(sent, inverse, bad id)``: the sorted ids sent, each looked-up id's
        place among them, and an id outside the table's rows (or None)."""
        ...

    def bound_rows(self, grads: Sequence[Tensor]) -> Sequence[Tensor]:
        """What each of ``grads`` (lookups' gradient rows, as pushed) adds at most to one
        element of the servers' sum, as rows whose largest magnitude bounds it
        (`parallax.engine.tables.verdict.bound_of` counts each tensor's largest once)."""
        ...


class Distinct:
    """The default: each id once (`unique_ids_many`)."""

    distinct = True
    requests = staticmethod(unique_ids_many)  # (the function itself: every pull calls it)

    def bound_rows(self, grads: Sequence[Tensor]) -> Sequence[Tensor]:
        return grads  # (one row per id: each element summed in once a message)


class EveryLookup:
    """The ablation's baseline: every looked-up id, repeats and all (`sorted_ids_many`)."""

    distinct = False
    requests = staticmethod(sorted_ids_many)

    def bound_rows(self, grads: Sequence[Tensor]) -> Sequence[Tensor]:
        # an id's repeats add into one element: the column sums of magnitudes bound that
        return [grad.detach().abs().sum(0, keepdim=True) for grad in grads]


#: each side by `Config.id_dedup`'s word
ID_DEDUP: dict[str, type[Distinct] | type[EveryLookup]] = {
    "workers": Distinct, "servers": EveryLookup}
