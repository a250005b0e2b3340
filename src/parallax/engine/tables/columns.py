"""A table held as column slices (`Config.pooled_by_columns`, TorchRec's column-wise sharding).

A program's ``R x d`` table cut into K slices of ``d/K`` columns is, in memory, the table of
``R*K`` rows of width ``d/K`` whose row ``r*K + k`` is slice k of row r (a view: no copy). Held
in K row partitions by ``id % K``, partition k is slice k, so the servers hold, update and
checkpoint the slices as they hold any rows (`parallax.engine.tables.server_table`), and only
pooling (`parallax.engine.tables.pooled`) and the places that make rows from their ids (a
`parallax.meta_init` recipe) need to know. Exact under every optimizer the servers accept:
they all update element by element (`parallax.engine.optimizers.shard_optimizer`; a factored
one such as ``Adafactor``, whose moments are kept per row and per column of the whole matrix,
is refused there for every table).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["column_slices", "slices_of_rows", "slices_view"]


def column_slices(width: int, servers: int) -> int:
    """The slices a row of ``width`` numbers is cut into over ``servers`` servers: the most
    that divide the width evenly, at most one per server (each slice on its own server)."""
    return max(k for k in range(1, max(1, min(width, servers)) + 1) if width % k == 0)


def slices_view(weight: Tensor, slices: int) -> Tensor:
    """``weight`` (``R x d``) as its ``R*slices`` slice rows of width ``d/slices`` (a view of
    a contiguous tensor, of a parameter built on meta too)."""
    return weight.reshape(weight.shape[0] * slices, -1)


def slices_of_rows(rows_of: Callable[[Tensor], Tensor], slices: int,
                   ) -> Callable[[Tensor], Tensor]:
    """From a maker of whole rows by id (a `parallax.meta_init` recipe's ``rows``), a maker
    of slice rows by slice-row id (``r*slices + k``: slice k of row r)."""
    def rows(ids: Tensor) -> Tensor:
        whole = rows_of(ids // slices)
        picked = whole.reshape(ids.numel(), slices, -1)
        return picked[torch.arange(ids.numel(), device=ids.device), ids % slices]
    return rows
