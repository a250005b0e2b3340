"""Lookup options whose effect depends on the whole batch, as the tables must apply them.

Detected in the model (`parallax.model.detect`), applied by the tables over the global batch
(`parallax.engine.tables.server_table`, `parallax.engine.tables.replicated`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from parallax.errors import UnsupportedProgramError

__all__ = ["BatchDependent", "check_batch_dependent", "check_one_lookup", "divide_by_counts",
           "scales_by_freq", "split_counts", "with_counts"]


@dataclass(frozen=True)
class BatchDependent:
    """The embedding options whose effect depends on the whole batch, as one lookup set them.

    ``max_norm`` (with ``norm_type``) renormalises, in place and before the lookup, every row
    the batch looks up; ``scale_grad_by_freq`` divides each row's gradient by its count in the
    batch. Distributed, "the batch" is the *global* batch: the servers (or every replica) see
    every worker's ids, so they apply both exactly (see `parallax.engine.tables.server_table`,
    `parallax.engine.tables.replicated`).
    """

    max_norm: float | None = None
    norm_type: float = 2.0
    scale_grad_by_freq: bool = False

    def describe(self) -> str:
        """The options as written in the model, e.g. ``max_norm=1.0, scale_grad_by_freq=True``."""
        parts = []
        if self.max_norm is not None:
            parts.append(f"max_norm={self.max_norm}"
                         + (f", norm_type={self.norm_type}" if self.norm_type != 2.0 else ""))
        if self.scale_grad_by_freq:
            parts.append("scale_grad_by_freq=True")
        return ", ".join(parts)


def scales_by_freq(options: BatchDependent | None) -> bool:
    """Whether a table with ``options`` divides each row's gradient by its global count."""
    return options is not None and options.scale_grad_by_freq


def divide_by_counts(grad: Tensor, total: Tensor) -> None:
    """scale_grad_by_freq: each row of ``grad`` (in place) over its count in the global batch,
    ``total``; rows nobody looked up have a zero gradient and stay so."""
    scale = torch.where(total > 0, 1 / total.clamp_min(1), torch.ones_like(total))
    grad.mul_(scale.view(-1, *[1] * (grad.dim() - 1)))


def with_counts(rows: Tensor, counts: Tensor) -> Tensor:
    """``rows`` flattened to ``[n, row size]`` with ``counts`` as one more column, so gradient
    rows and their lookup counts travel (and are merged) together."""
    return torch.cat([rows.reshape(rows.shape[0], -1),
                      counts.to(rows.dtype).unsqueeze(1)], dim=1)


def split_counts(packed: Tensor, row_shape: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """Undo `with_counts`: ``(rows [n, *row_shape], counts [n])``."""
    return packed[:, :-1].reshape(-1, *row_shape), packed[:, -1].contiguous()


def check_batch_dependent(name: str, options: BatchDependent | None, sparse_grad: bool) -> None:
    """Refuse what torch refuses on one device: scale_grad_by_freq with sparse gradients."""
    if options is not None and options.scale_grad_by_freq and sparse_grad:
        raise UnsupportedProgramError(
            f"parameter '{name}': scale_grad_by_freq=True with sparse gradients (sparse=True, "
            "or Config(lazy_sparse_updates=True), which is defined as sparse=True) is refused "
            "by torch on one device too ('embedding_backward: scale_grad_by_freq not "
            "supported with sparse gradients')")


def check_one_lookup(name: str, rank: int, lookups: int) -> None:
    """Refuse a table's second lookup with gradients in one step when it scales by frequency."""
    if lookups <= 1:
        return
    raise UnsupportedProgramError(
        f"rank {rank}: parameter '{name}' has scale_grad_by_freq=True and was looked up a "
        "second time in one step; on one device each lookup scales by its own counts, which "
        "parallax reproduces only for one lookup per step (a table with scale_grad_by_freq "
        "must be looked up once per forward; concatenate the ids into one call)")
