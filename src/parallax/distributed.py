"""`distribute`: keep your own training loop, as DDP and Horovod do.

    model, optimizer = parallax.distribute(model, optimizer, config=parallax.Config())
    for inputs, targets in parallax.shard(loader):
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), targets)     # any outputs, any loss
        loss.backward()
        optimizer.step()

The returned model's forward returns exactly what the user's module returns, pulling the sparse
rows it reads from the servers; ``optimizer.step()`` pushes the step's gradient rows, checks
finiteness on every rank, and applies the dense update here and the servers' update there.
Both drive the same `Runner` round as `Runner.step` does (one engine, two doors), so training
equals the single-device program with the global batch. The optimizer is, like Horovod's
``DistributedOptimizer``, an instance of a subclass of the user's optimizer class (so lr
schedulers and ``isinstance`` checks work); use it instead of the original.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.amp.grad_scaler import OptState

from parallax.api import get_runner
from parallax.config import Config
from parallax.engine.shard_optimizer import as_optimizer_list
from parallax.errors import UnsupportedProgramError
from parallax.runner import Runner

__all__ = ["DistributedModel", "DistributedOptimizer", "GradScaler", "clip_grad_norm_",
           "distribute"]

# Each parameter of a distributed model knows its runner (weakly): how clip_grad_norm_ finds
# it. An attribute, not a table keyed by id: ids of dead parameters are reused.
_RUNNER_ATTRIBUTE = "_parallax_runner"


def distribute(model: nn.Module,
               optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer], *,
               config: Config | None = None, resources: str | os.PathLike | None = None,
               ) -> tuple[DistributedModel, Any]:
    """The model and optimizer(s) of a data-parallel run of this program (collective: call it
    on every worker). ``optimizer`` is one optimizer or a list; the same shape comes back.

    Launching is as for `parallax.get_runner` (``parallax run``, ``torchrun``, ``resources``
    or a one-worker run in this process). Every trainable parameter must be in one of the
    optimizers (on one device a parameter in none is never updated; here it would be a silent
    divergence of the servers' rows, so it is refused).

    Example::

        model, optimizer = parallax.distribute(model, torch.optim.Adagrad(model.parameters()))
    """
    optimizers = as_optimizer_list(optimizer)
    if config is not None and config.parallelism != "data":
        raise UnsupportedProgramError(
            f"parallax.distribute with Config.parallelism={str(config.parallelism)!r}: the "
            f"split layers' parameters are new (DTensor) objects that the program's own loop "
            f"does not hold; train with parallax.get_runner(...).step(batch) instead")
    _check_every_parameter_optimized(model, optimizers)
    wrapped = [_distributed_optimizer(opt) for opt in optimizers]
    runner = get_runner(model, wrapped, _no_loss, resources=resources, config=config)
    runner.checks_phases = True
    for opt in wrapped:
        opt.parallax_runner = runner
    for param in model.parameters():
        setattr(param, _RUNNER_ATTRIBUTE, weakref.ref(runner))
    distributed = DistributedModel(runner)
    return distributed, (wrapped if isinstance(optimizer, (list, tuple)) else wrapped[0])


def clip_grad_norm_(parameters: Iterable[nn.Parameter] | nn.Parameter, max_norm: float,
                    norm_type: float = 2.0) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a distributed model: clips by the L2 norm of the
    *aggregated* gradients, the servers' rows included, as on one device; returns the norm.
    Collective (it pushes the step's gradients if ``optimizer.step()`` has not yet).

    ``torch.nn.utils.clip_grad_norm_`` itself sees only the replicated parameters' gradients:
    call this one on a distributed model.
    """
    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    if float(norm_type) != 2.0:
        raise UnsupportedProgramError(
            f"parallax.clip_grad_norm_ clips by the L2 norm (norm_type=2.0), got norm_type="
            f"{norm_type!r}")
    runners = {id(r): r for p in params
               if (ref := getattr(p, _RUNNER_ATTRIBUTE, None)) is not None
               and (r := ref()) is not None}
    if len(runners) != 1:
        raise UnsupportedProgramError(
            "parallax.clip_grad_norm_ takes parameters of one model returned by "
            f"parallax.distribute (got parameters of {len(runners)} such model(s)); for other "
            "models use torch.nn.utils.clip_grad_norm_")
    (runner,) = runners.values()
    return torch.tensor(runner.clip_grad_norm(float(max_norm), params), dtype=torch.float64)


def _no_loss(output: Any, target: Any) -> Tensor:
    raise UnsupportedProgramError(
        "a model from parallax.distribute computes its loss in your loop: use model(inputs) "
        "and loss.backward(), not Runner.step")


def _check_every_parameter_optimized(model: nn.Module,
                                     optimizers: list[torch.optim.Optimizer]) -> None:
    held = {id(p) for opt in optimizers for group in opt.param_groups for p in group["params"]}
    missing = [name for name, p in model.named_parameters()
               if p.requires_grad and id(p) not in held]
    if missing:
        raise UnsupportedProgramError(
            f"parameter(s) {missing} require gradients but are in none of the optimizers "
            f"given to parallax.distribute; add them to an optimizer, or set "
            f"requires_grad_(False) on them")


class DistributedModel(nn.Module):
    """The user's module, trained data-parallel: ``forward`` returns what it returns;
    ``state_dict``/``load_state_dict`` are the single-device ones; ``train``/``eval`` and
    attribute access reach the user's module. Parameters are the user's (``module.`` names,
    as under DDP); use the optimizer `distribute` returned."""

    def __init__(self, runner: Runner):
        super().__init__()
        self.module = runner.model
        object.__setattr__(self, "runner", runner)  # not a submodule: no second parameter set

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.runner.forward_call(args, kwargs)

    def train(self, mode: bool = True) -> DistributedModel:
        super().train(mode)
        self.runner.module.train(mode)  # the copy that runs
        return self

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate dense gradients locally in the backwards inside (DDP's ``no_sync``); the
        sparse rows are pushed once per step in any case. Exact either way; saves
        AllReduces when accumulating micro-batches."""
        module = self.runner.module
        with module.no_sync() if hasattr(module, "no_sync") else contextlib.nullcontext():
            yield

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Tensor]:  # type: ignore[override]
        """The plain single-device ``state_dict`` of the user's module (collective)."""
        if args or kwargs:
            raise UnsupportedProgramError(
                "DistributedModel.state_dict() takes no arguments: it returns the plain "
                "single-device state dict of your module")
        return self.runner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Tensor], strict: bool = True,
                        assign: bool = False) -> Any:
        """Load a single-device ``state_dict`` of the user's module: dense values here, the
        servers' rows on the servers (every worker passes the same values). Optimizer state
        is untouched, as on one device."""
        if assign:
            raise UnsupportedProgramError("DistributedModel.load_state_dict(assign=True) is "
                                          "not supported: the servers keep their own rows")
        return self.runner.load_state_dict(state_dict, strict=strict)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self._modules.get("module")
            if module is None:
                raise
            return getattr(module, name)  # the user's own methods, e.g. init_hidden


class DistributedOptimizer:
    """Mixed into a subclass of the user's optimizer class by `distribute`.

    ``step()`` (and ``step(closure)``) pushes this step's gradients, checks them and applies
    this optimizer's update (replicated parameters here, its server-held rows on the servers);
    ``zero_grad()`` clears its parameters' gradients, the servers' rows included;
    ``state_dict()`` / ``load_state_dict()`` are the single-device ones, the servers' state
    included (collective).
    """

    parallax_base: type[torch.optim.Optimizer]
    parallax_runner: Runner
    # GradScaler then hands its scale and inf check to step() instead of unscaling only the
    # gradients it can see (not the servers' rows): how its use is recognised and refused.
    _step_supports_amp_scaling = True

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        if hasattr(self, "found_inf"):
            raise UnsupportedProgramError(
                "torch.amp.GradScaler would unscale and check only the replicated gradients, "
                "not the servers' rows: use parallax.GradScaler (the same class, for "
                "distributed optimizers)")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.parallax_runner.apply_update([self])  # type: ignore[list-item]
        return loss

    def parallax_dense_step(self) -> None:
        """The user's optimizer class's own update of the parameters held here."""
        self.parallax_base.step(self)  # type: ignore[arg-type]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.parallax_runner.zero_grad([self])  # type: ignore[list-item]

    def state_dict(self) -> dict:  # type: ignore[override]
        """The single-device ``state_dict`` (collective: call it on every rank): the
        servers' state of server-held parameters gathered whole."""
        return self.parallax_runner.optimizer_state_dict(self)  # type: ignore[arg-type]

    def load_state_dict(self, state_dict: dict) -> None:  # type: ignore[override]
        """Load a single-device ``state_dict`` (every rank passes the same): the servers
        take their rows of the server-held parameters' state."""
        self.parallax_runner.load_optimizer_state_dict(self, state_dict)  # type: ignore[arg-type]


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` for the optimizers of `distribute`: ``unscale_`` (explicit, or
    inside ``step``) also unscales the servers' aggregated rows, and its inf/NaN check covers
    them, one decision on every rank and server; a step it skips ends like a taken one.
    Everything else (``scale``, ``update``, state dicts) is torch's. ``Config.clip_grad_norm``
    does not combine with it: clip with `clip_grad_norm_` after ``unscale_``.

    Example::

        scaler = parallax.GradScaler("cpu")
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        parallax.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
    """

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: Tensor,
                        found_inf: Tensor, allow_fp16: bool) -> dict[torch.device, Tensor]:
        runner = getattr(optimizer, "parallax_runner", None)
        if runner is not None:  # first the push: it also sets the replicated tables' grads
            runner.sync_gradients(scaled=True)
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        if runner is not None:
            if runner.unscale_tables([optimizer], inv_scale):
                found_inf.fill_(1.0)
            per_device.setdefault(found_inf.device, found_inf)
        return per_device

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless ``unscale_`` did), then ``optimizer.step()`` unless an overflow
        was found anywhere, as torch's; a skipped step still ends the parallax step."""
        if not self.is_enabled() or not isinstance(optimizer, DistributedOptimizer):
            return super().step(optimizer, *args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is "
                               "enabled.")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        result = None
        if not sum(float(v) for v in state["found_inf_per_device"].values()):
            result = optimizer.step(*args, **kwargs)
        else:
            optimizer.parallax_runner.skip_update([optimizer])
        state["stage"] = OptState.STEPPED
        return result


def _distributed_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """An instance of ``Distributed<its class>`` over the same param groups and state."""
    if isinstance(optimizer, DistributedOptimizer):
        raise UnsupportedProgramError(
            f"{type(optimizer).__name__} is already distributed; pass the original optimizer")
    base = type(optimizer)
    cls = type(f"Distributed{base.__name__}", (DistributedOptimizer, base),
               {"parallax_base": base, "__doc__": DistributedOptimizer.__doc__})
    wrapped = cls.__new__(cls)
    # The same param groups, state and hooks; not an lr scheduler's patch of ``step`` on the
    # original (it would bypass the distributed step).
    wrapped.__dict__.update({k: v for k, v in optimizer.__dict__.items()
                             if k not in ("step", "zero_grad", "_opt_called")})
    return wrapped
