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

import torch
from torch.utils import _pytree

from parallax.errors import UnsupportedProgramError

__all__ = ["refuse_a_second_backward"]


def refuse_a_second_backward(output: Any, rank: int) -> None:
    """Hook ``output`` (one forward's) so that a backward reaching it after an earlier one
    through it ended raises `UnsupportedProgramError`."""
    tensors = [t for t in _pytree.tree_leaves(output)
               if isinstance(t, torch.Tensor) and t.requires_grad]
    state = {"running": False, "ended": False}

    def reached(_grad: torch.Tensor) -> None:
        if state["ended"]:
            raise UnsupportedProgramError(
                f"rank {rank}: a second backward through the outputs of one forward of the "
                f"distributed model (loss.backward(retain_graph=True), then another backward) "
                f"is not supported: the dense gradients are averaged over the workers once per "
                f"forward, as under DDP, so the second backward's would not be, and training "
                f"would silently differ from one device. Add the losses and call backward once "
                f"((loss1 + loss2).backward()), or run the forward again")
        if not state["running"]:
            state["running"] = True
            torch.autograd.Variable._execution_engine.queue_callback(
                lambda: state.update(running=False, ended=True))

    for tensor in tensors:
        tensor.register_hook(reached)
