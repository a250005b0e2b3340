"""The reference run of ``parallax verify --reference ORIGINAL``: the program the user started
from, before the port, with no parallax in it.

The port's own reference (the port on one process) cannot show the port's mistakes: a
schedule sized from the unsharded loader is the same mistake in both runs. Here the original
program runs as it is, with each ``DataLoader``'s batch ``W`` times its ``batch_size`` (the
distributed run's global batch, as the port's reference reads it through ``parallax.shard``).

A plain program names no model, so the recorder finds it: at the first ``optimizer.step()``
(torch's global optimizer step hooks), the outermost module holding every parameter of the
stepping optimizer. A step is every optimizer the program steps once (a GAN's two): each state
is recorded when the next step begins, the last one when the run ends.
"""

from __future__ import annotations

import atexit
import functools
import gc
from typing import Any

import torch
import torch.optim.optimizer as optimizers
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from parallax.errors import UsageError, VerifyComplete
from parallax.verify.record import StateRecorder, Verification, add_hint, describe_run

__all__ = ["install", "program_model"]


def install(verification: Verification, script: str) -> None:
    """Before ``script`` runs: its loaders read the global batch, and its optimizer steps
    record the model's state (ending the run after ``verification.steps``)."""
    _scale_loaders(verification.workers)
    _Recorder(verification, script).install()


def _scale_loaders(workers: int) -> None:
    """Every ``DataLoader`` made from now on batches ``workers`` times its ``batch_size``
    (one given a ``batch_sampler`` is left as it is, and said)."""
    made = DataLoader.__init__

    @functools.wraps(made)
    def init(self: DataLoader[Any], dataset: Any, batch_size: int | None = 1,
             *args: Any, **kwargs: Any) -> None:
        batches = args[2] if len(args) > 2 else kwargs.get("batch_sampler")
        if batches is not None:
            add_hint(f"the original program's DataLoader has a batch_sampler "
                     f"({type(batches).__name__}): its batches were not made {workers} times "
                     f"larger, so that run's batch is not the distributed run's global batch")
        elif batch_size is not None:
            batch_size *= workers
        made(self, dataset, batch_size, *args, **kwargs)

    DataLoader.__init__ = init  # type: ignore[method-assign]


def program_model(optimizer: torch.optim.Optimizer) -> nn.Module:
    """The outermost module holding every parameter ``optimizer`` trains (the program's
    model), without a DDP wrapper; the one with most parameters if several are outermost."""
    wanted = {id(p) for group in optimizer.param_groups for p in group["params"]}
    holders = [obj for obj in gc.get_objects() if isinstance(obj, nn.Module)
               and wanted <= {id(p) for p in obj.parameters()}]
    inner = {id(child) for holder in holders for child in holder.modules() if child is not holder}
    outermost = [holder for holder in holders if id(holder) not in inner]
    if not outermost:
        raise UsageError("parallax verify --reference: the original program's optimizer "
                         "steps parameters that no nn.Module holds: nothing to compare")
    model = max(outermost, key=lambda m: sum(p.numel() for p in m.parameters()))
    return model.module if isinstance(model, DistributedDataParallel) else model


class _Recorder:
    """Records the original program's model around its optimizers' steps."""

    def __init__(self, verification: Verification, script: str) -> None:
        self.verification = verification
        self.script = script
        self.recorder = StateRecorder(verification, writes=True)
        self.model: nn.Module | None = None
        self.stepped: set[int] = set()  # optimizers stepped since the last record

    def install(self) -> None:
        optimizers.register_optimizer_step_pre_hook(self.before_step)
        optimizers.register_optimizer_step_post_hook(self.after_step)
        atexit.register(self.at_exit)

    def before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.model is None:  # the first step: the state before training
            self.model = program_model(optimizer)
            describe_run(self.verification, self.model,
                         f"the original program {self.script} (no parallax), each DataLoader "
                         f"{self.verification.workers} x its batch_size")
            self.recorder.record(self.model.state_dict())
        elif id(optimizer) in self.stepped:  # a new step begins: the last one is complete
            self._record()
            if self.recorder.done:
                raise VerifyComplete(self.verification.steps)

    def after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.stepped.add(id(optimizer))

    def _record(self) -> None:
        assert self.model is not None
        self.recorder.record(self.model.state_dict())
        self.stepped.clear()

    def at_exit(self) -> None:
        """The program ended: its last step is complete."""
        if self.stepped and not self.recorder.done:
            self._record()
