"""`BagUse`: what a table's ``nn.EmbeddingBag`` calls read (or an ``nn.Embedding``'s rows
summed over bags: `parallax.model.bag_reductions`), counted for the plan."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

__all__ = ["BagUse"]


@dataclass
class BagUse:
    """The ids and bags of a table's ``nn.EmbeddingBag`` calls with gradients (or of the sums
    and means over bags of its ``nn.Embedding`` rows), summed over the steps `Table.rows_used`
    counts (what predicts pooling's bytes: `parallax.planning.cost.pooled_bags`)."""

    ids: int = 0
    bags: int = 0
    #: some call's per-sample weights required a gradient (its bags cannot be pooled)
    weights_need_grad: bool = False
    #: an ``nn.Embedding``'s rows were used otherwise than summed or averaged over bags
    rows_read_otherwise: bool = False

    def add(self, ids: Tensor, offsets: Tensor | None, include_last_offset: bool,
            weights: Tensor | None = None) -> None:
        self.weights_need_grad |= weights is not None and weights.requires_grad
        self.ids += ids.numel()
        if ids.dim() == 2 or offsets is None:
            self.bags += ids.shape[0] if ids.dim() == 2 else 0
        else:
            self.bags += max(offsets.numel() - int(include_last_offset), 0)
