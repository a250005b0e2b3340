"""The reference run of ``parallax verify`` for a `parallax.distribute` program: the program
as it is on one device, in plain PyTorch.

`parallax.distribute` returns the program's own module (in a thin wrapper that answers what a
`DistributedModel` answers: ``module``, ``no_sync``, the plain ``state_dict``) and its own
optimizer(s), untouched; parallax's engine is not involved, so the comparison is with the
single-device program itself. `parallax.shard` gives the global batch (`shard_for_reference`).
A one-process gloo group stands in for the launch, so ``dist.get_rank()`` answers 0.
"""

from __future__ import annotations

import atexit
import contextlib
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.hooks import RemovableHandle

from parallax.errors import VerifyComplete
from parallax.model.wrapper import ModuleWrapper
from parallax.verify.record import StateRecorder, Verification, add_hint, describe_run
from parallax.verify.run import note_unsharded

__all__ = ["ReferenceModel", "reference_pair"]


class ReferenceModel(ModuleWrapper):
    """The user's module, trained as it is (``parallax verify``'s reference run)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @property
    def plain(self) -> nn.Module:
        """The user's module without a DDP wrapper (whose names a state dict carries)."""
        inner = self.module
        return inner.module if isinstance(inner, DistributedDataParallel) else inner

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        module = self.module
        with (module.no_sync() if isinstance(module, DistributedDataParallel)
              else contextlib.nullcontext()):
            yield

    @contextlib.contextmanager
    def join(self, *args: Any, **kwargs: Any) -> Iterator[None]:
        """DDP's ``join()``: one process has no uneven inputs."""
        yield

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Tensor]:  # type: ignore[override]
        return self.plain.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True,
                        assign: bool = False) -> Any:
        return self.plain.load_state_dict(state_dict, strict=strict, assign=assign)


def reference_pair(verification: Verification, model: nn.Module,
                   optimizers: Sequence[torch.optim.Optimizer],
                   timeout: timedelta) -> ReferenceModel:
    """Record ``model``'s state now and after every step of ``optimizers``; the model to hand
    back to the program (the optimizers go back as they are)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=timeout)
        atexit.register(_leave)
    wrapped = ReferenceModel(model)
    describe_run(verification, wrapped.plain, "plain PyTorch (parallax.distribute returned "
                 "the program's own module and optimizer)")
    recorder = StateRecorder(verification, writes=True)
    recorder.record(wrapped.state_dict())
    stepped: set[int] = set()
    everyone = {id(opt) for opt in optimizers}

    def after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        stepped.add(id(optimizer))
        if stepped >= everyone:  # a step: every optimizer once, as the runner counts
            stepped.clear()
            recorder.record(wrapped.state_dict())
            note_unsharded(recorder)
            if recorder.done:
                autocast_hook.remove()
                raise VerifyComplete(verification.steps)

    for optimizer in optimizers:
        optimizer.register_step_post_hook(after_step)
    autocast_hook = _hint_at_autocast()
    return wrapped


def _hint_at_autocast() -> RemovableHandle:
    """Add a hint the first time a module runs under ``torch.autocast`` (a global forward
    hook, until then or until the run's last step): its low-precision results depend on the
    batch's split (each worker's partial sums are rounded before the sum over workers, as
    under DDP), so the runs agree only to that precision."""
    def seen(module: nn.Module, args: Any, output: Any) -> None:
        for device in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device):
                dtype = str(torch.get_autocast_dtype(device)).removeprefix("torch.")
                add_hint(f"the program computes under torch.autocast ({device}, {dtype}): "
                         f"each worker's partial sums are rounded to {dtype} before the sum "
                         f"over workers, as under DDP, so the runs agree only to {dtype}'s "
                         f"precision; verify without autocast to check the rest")
                handle.remove()
                return

    handle = nn.modules.module.register_module_forward_hook(seen)
    return handle


def _leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
