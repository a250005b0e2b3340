"""One backward per forward in the own loop: a second one through the same outputs is refused,
and the one taken is timed as the step's backward phase (the program's own ``loss.backward()``:
from the first gradient that reaches the forward's outputs to the backward's end). One hook
per output does both.

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
from parallax.engine.diagnostics.phases import PhaseClock
from parallax.errors import UnsupportedProgramError

__all__ = ["watch_backwards"]


def watch_backwards(output: Any, rank: int, clock: PhaseClock) -> None:
    """Hook ``output`` (one forward's) so that a backward reaching it is timed on ``clock``
    as the phase ``backward``, and one after an earlier one through it ended raises
    `UnsupportedProgramError`."""
    ended = timed = False

    def first() -> bool:
        nonlocal timed
        if ended:
            raise UnsupportedProgramError(
                f"rank {rank}: a second backward through the outputs of one forward of the "
                f"distributed model (loss.backward(retain_graph=True), then another backward) "
                f"is not supported: the dense gradients are averaged over the workers once per "
                f"forward, as under DDP, so the second backward's would not be, and training "
                f"would silently differ from one device. Add the losses and call backward once "
                f"((loss1 + loss2).backward()), or run the forward again")
        timed = clock.open_on_step_thread("backward")
        return True

    def end() -> None:
        nonlocal ended
        ended = True
        if timed:
            clock.close("backward")

    on_each_backward(output, first, end)
