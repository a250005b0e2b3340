"""One backward per forward in the own loop: a second one through the same outputs is refused.

``loss.backward(retain_graph=True)`` followed by another backward through the same forward's
graph trains exactly on one device, but not on several workers: DDP's reducer averages the
dense gradients once per forward (its hooks are armed by the forward), so the second
backward's dense gradients stay this worker's own, and the model silently leaves the
single-device program's (seen: 0.19 off after 4 steps on 2 workers). Every such program is
refused at the second backward, on every rank alike (every rank runs the same program), with
the fix: add the losses and call backward once, or run the forward again.
"""

from __future__ import annotations

from typing import Any

from parallax.engine.backward_ends import on_each_backward
from parallax.errors import UnsupportedProgramError

__all__ = ["refuse_a_second_backward"]


def refuse_a_second_backward(output: Any, rank: int) -> None:
    """Hook ``output`` (one forward's) so that a backward reaching it after an earlier one
    through it ended raises `UnsupportedProgramError`."""
    ended = False

    def first() -> bool:
        if ended:
            raise UnsupportedProgramError(
                f"rank {rank}: a second backward through the outputs of one forward of the "
                f"distributed model (loss.backward(retain_graph=True), then another backward) "
                f"is not supported: the dense gradients are averaged over the workers once per "
                f"forward, as under DDP, so the second backward's would not be, and training "
                f"would silently differ from one device. Add the losses and call backward once "
                f"((loss1 + loss2).backward()), or run the forward again")
        return True

    def end() -> None:
        nonlocal ended
        ended = True

    on_each_backward(output, first, end)
