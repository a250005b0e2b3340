"""Torch's errors that a parallax program meets through the engine, said in parallax's terms.

The dense sync runs the program's model under DDP, which the program never built: DDP's own
advice ("pass find_unused_parameters=True to DistributedDataParallel") points at a call the
user cannot make. `TorchErrors` turns the DDP errors a forward or backward can meet into a
`ParallaxError` naming the rank, the parameters and the parallax fix, the original chained.
(Failed collectives are the `Explainer`'s: it names the rank that is missing.)
"""

from __future__ import annotations

import re
from collections.abc import Callable
from types import TracebackType

import torch
from torch import nn

from parallax.errors import ParallaxError, UnsupportedProgramError

__all__ = ["TorchErrors", "ddp_parameter_names", "translated"]

_UNUSED = "Expected to have finished reduction in the prior iteration"
_READY_TWICE = "Expected to mark a variable ready only once"
_DEVICES = "Expected all tensors to be on the same device"
_INDICES = re.compile(r"Parameter indices which did not receive grad for rank \d+: ([\d ]+)")


def translated(error: BaseException, *, rank: int, step: int, device: torch.device,
               dense_names: Callable[[], list[str]]) -> ParallaxError | None:
    """The parallax error for torch's ``error`` (None: not one we know). ``dense_names``:
    the names of the parameters DDP synchronises, in its order (its messages give indices)."""
    text = str(error)
    if _UNUSED in text:
        found = _INDICES.search(text)
        names = dense_names()
        unused = ([names[int(i)] for i in found.group(1).split() if int(i) < len(names)]
                  if found else [])
        which = f"the dense parameter(s) {unused}" if unused else "some dense parameters"
        return UnsupportedProgramError(
            f"rank {rank}: {which} got no gradient in step {step - 1} (a layer the forward "
            f"uses only in some steps, or an output the loss does not use): the dense "
            f"parameters' AllReduce (DDP) waits for every gradient. Pass "
            f"parallax.Config(find_unused_parameters=True) to parallax.distribute or "
            f"get_runner (one more small all-reduce per step), or use every layer in every "
            f"step")
    if _READY_TWICE in text:
        return UnsupportedProgramError(
            f"rank {rank}: a dense parameter got its gradient twice in one backward of step "
            f"{step} (reentrant activation checkpointing, torch.utils.checkpoint with "
            f"use_reentrant=True, or a module run twice with find_unused_parameters): the "
            f"dense parameters' AllReduce (DDP) sends each gradient once. Use "
            f"torch.utils.checkpoint(..., use_reentrant=False)")
    if _DEVICES in text:
        return UnsupportedProgramError(
            f"rank {rank}: tensors on different devices in step {step}: {text.splitlines()[0]}"
            f". This worker's model runs on {device} (parallax.cluster.current_worker()"
            f".device): move the batch there (Runner.step moves it for you)")
    return None


def ddp_parameter_names(module: nn.Module) -> list[str]:
    """The parameters ``module`` (a DDP wrapper, or the module itself where no DDP runs)
    synchronises, in DDP's order: the indices of its messages."""
    if not isinstance(module, nn.parallel.DistributedDataParallel):
        return []
    ignored = set(module.parameters_to_ignore)
    return [name for name, param in module.module.named_parameters()
            if param.requires_grad and name not in ignored]


class TorchErrors:
    """``with errors:`` — a torch error `translated` knows, raised inside, becomes its
    parallax error (the original chained); anything else goes on as it is."""

    def __init__(self, rank: int, device: torch.device, step: Callable[[], int],
                 dense_names: Callable[[], list[str]]) -> None:
        self.rank = rank
        self.device = device
        self.step = step
        self.dense_names = dense_names

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        if error is None:
            return
        parallax_error = self.translate(error)
        if parallax_error is not None:
            raise parallax_error from error

    def translate(self, error: BaseException | None) -> ParallaxError | None:
        """``error`` in parallax's terms, or None (not a torch error we know). Also for an
        error raised where no ``with`` reaches: the own loop's ``loss.backward()``, whose
        uncaught error `parallax.session` explains after its traceback."""
        if not isinstance(error, RuntimeError) or isinstance(error, ParallaxError):
            return None
        return translated(error, rank=self.rank, step=self.step(), device=self.device,
                          dense_names=self.dense_names)
