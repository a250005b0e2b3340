"""Each backward through one forward's outputs, from its first gradient to its end.

The own loop's ``loss.backward()`` is the program's, not ours; what must happen around it (its
phase timed, a second one through the same outputs refused) hooks the forward's outputs: the
first gradient that reaches them starts a backward, and autograd's queued callback (as DDP's
reducer uses) marks its end.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree

__all__ = ["on_each_backward"]


def on_each_backward(output: Any, first: Callable[[], bool], end: Callable[[], None]) -> None:
    """In each backward that reaches ``output``'s tensors: ``first()`` at the first gradient
    that arrives (it may raise to stop the backward), and, where it returned True, ``end()``
    once that backward has ended."""
    state = {"running": False}

    def reached(_grad: torch.Tensor) -> None:
        if state["running"]:
            return
        state["running"] = True
        wanted = first()

        def ended() -> None:
            state["running"] = False
            if wanted:
                end()
        torch.autograd.Variable._execution_engine.queue_callback(ended)

    # (a forward that returns one tensor, the usual case: no tree walk each step)
    leaves = [output] if isinstance(output, torch.Tensor) else _pytree.tree_leaves(output)
    for tensor in leaves:
        if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
            tensor.register_hook(reached)
