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
from collections.abc import Callable, Iterator, Sequence
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
    buffers_before = _own_buffers(wrapped.plain)
    stepped: set[int] = set()
    everyone = {id(opt) for opt in optimizers}

    def after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        stepped.add(id(optimizer))
        if stepped >= everyone:  # a step: every optimizer once, as the runner counts
            stepped.clear()
            recorder.record(wrapped.state_dict())
            note_unsharded(recorder)
            if buffers_before:  # the first step: which buffers did it change?
                _hint_at_updated_buffers(buffers_before, _own_buffers(wrapped.plain))
                buffers_before.clear()
            if recorder.done:
                autocast_hook.remove()
                means_hook()
                raise VerifyComplete(verification.steps)

    for optimizer in optimizers:
        optimizer.register_step_post_hook(after_step)
    autocast_hook = _hint_at_autocast()
    means_hook = _hint_at_uneven_means()
    return wrapped


def _own_buffers(model: nn.Module) -> dict[str, Tensor]:
    """Copies of ``model``'s buffers outside BatchNorm layers (whose hint is said already)."""
    return {f"{path}.{name}".lstrip("."): buffer.detach().clone()
            for path, module in model.named_modules()
            if not isinstance(module, nn.modules.batchnorm._BatchNorm)
            for name, buffer in module.named_buffers(recurse=False)}


def _hint_at_updated_buffers(before: dict[str, Tensor], after: dict[str, Tensor]) -> None:
    """Add a hint naming the buffers a training step changed: the forward updates them from
    its batch, which on several workers is each worker's part (the state dict holds rank 0's,
    as DDP's broadcast of buffers does), so they differ from one device's."""
    changed = [name for name, value in before.items()
               if name in after and not torch.equal(after[name], value)]
    if changed:
        add_hint(f"buffer(s) {', '.join(repr(n) for n in changed[:4])}"
                 f"{f' and {len(changed) - 4} more' if len(changed) > 4 else ''} changed in a "
                 f"training step: a buffer the forward updates from its batch is updated by each "
                 f"worker from its own part (the state dict holds rank 0's, as DDP broadcasts "
                 f"rank 0's buffers), so it and what reads it differ from one device's, as under "
                 f"DDP; a count or statistic of the global batch needs the workers' parts summed "
                 f"(torch.distributed.all_reduce)")


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


# torch's losses whose mean divides by a count of the batch's targets (the ones not ignored,
# or their class weights): argument positions of target, weight, ignore_index and reduction
_COUNTED_MEANS = {"cross_entropy": (1, 2, 4, 6), "nll_loss": (1, 2, 4, 6)}


def _hint_at_uneven_means() -> Callable[[], None]:
    """Add a hint the first time ``F.cross_entropy`` or ``F.nll_loss`` (their modules call
    them) averages over a count the workers need not share: class-index targets with
    ``ignore_index`` among them, or class weights. Each worker then divides by its own count
    (as under DDP); `parallax.global_mean` divides by the global one. Returns what puts the
    functions back."""
    functional = torch.nn.functional
    originals = {name: getattr(functional, name) for name in _COUNTED_MEANS}

    def watched(name: str) -> Callable[..., Tensor]:
        original = originals[name]
        target_at, weight_at, ignore_at, reduction_at = _COUNTED_MEANS[name]

        def call(*args: Any, **kwargs: Any) -> Tensor:
            def given(at: int, key: str, default: Any) -> Any:
                return args[at] if len(args) > at else kwargs.get(key, default)

            target = given(target_at, "target", None)
            if (given(reduction_at, "reduction", "mean") == "mean"
                    and isinstance(target, Tensor) and not target.is_floating_point()
                    and (given(weight_at, "weight", None) is not None
                         or bool((target == given(ignore_at, "ignore_index", -100)).any()))):
                add_hint(f"the loss's F.{name} averages over the targets it does not ignore "
                         f"(ignore_index) or over their class weights: each worker divides "
                         f"by its own count, as under DDP, not by the global batch's; sum it "
                         f"and divide by the global count to train exactly: parallax."
                         f"global_mean(F.{name}(..., reduction='sum'), count), count the "
                         f"targets not ignored (or their weights)")
                restore()
            result: Tensor = original(*args, **kwargs)
            return result

        return call

    def restore() -> None:
        for name, original in originals.items():
            setattr(functional, name, original)

    for name in _COUNTED_MEANS:
        setattr(functional, name, watched(name))
    return restore


def _leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
