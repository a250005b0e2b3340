"""Losses that average over a count the workers do not share (`global_mean`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from parallax.errors import UnsupportedProgramError
from parallax.session import live_runners
from parallax.step import global_mean as _mean

if TYPE_CHECKING:
    from parallax.runner import Runner

__all__ = ["global_mean"]


def global_mean(total: Tensor, count: Tensor | float) -> Tensor:
    """``total / count`` over the *global* batch: the single-device mean of a sum whose count
    of items differs between workers, where a plain mean would make each worker divide by its
    own count (as under DDP) and train a different model than one device.

    Use it in place of a mean reduction that divides by a count of the batch::

        # F.cross_entropy(logits, targets, ignore_index=PAD) becomes
        loss = parallax.global_mean(
            F.cross_entropy(logits, targets, ignore_index=PAD, reduction="sum"),
            (targets != PAD).sum())
        # class weights: count = weight[targets].sum(); a masked mean: count = mask.sum()

    ``total``: this worker's sum (one value, with autograd); ``count``: what it is divided
    by on one device, this worker's part (a number or a one-value tensor). On several workers
    it is collective (one small all_gather of the counts: call it on every rank in the same
    place, as the model) and returns one device's mean on every rank, its gradient scaled so
    that the workers' averaged gradients are one device's. In a program with no distributed
    model (the single-device run of the same program) it is ``total / count``; so it is with
    one worker, and under asynchronous training (each worker's gradient applies on its own).
    """
    runners = live_runners()
    if not runners:
        return _mean.plain_mean(total, count)
    averaging = {(r.config.average_dense, r.config.average_sparse) for r in runners}
    if len(averaging) > 1:
        raise UnsupportedProgramError(
            "parallax.global_mean: the run's models average their gradients differently "
            f"(Config average_dense/average_sparse: {sorted(averaging)}); give them one "
            "setting")
    runner: Runner = runners[0]
    return runner.global_mean(total, count)
