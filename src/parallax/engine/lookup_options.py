"""Lookup options whose effect depends on the whole batch, as the tables must apply them.

Detected in the model (`parallax.model.detect`), applied by the tables over the global batch
(`parallax.engine.server_table`, `parallax.engine.replicated`).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BatchDependent"]


@dataclass(frozen=True)
class BatchDependent:
    """The embedding options whose effect depends on the whole batch, as one lookup set them.

    ``max_norm`` (with ``norm_type``) renormalises, in place and before the lookup, every row
    the batch looks up; ``scale_grad_by_freq`` divides each row's gradient by its count in the
    batch. Distributed, "the batch" is the *global* batch: the servers (or every replica) see
    every worker's ids, so they apply both exactly (see `parallax.engine.server_table`,
    `parallax.engine.replicated`).
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
