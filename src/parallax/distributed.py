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
import dataclasses
import os
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.amp.grad_scaler import OptState
from torch.nn.parallel import DistributedDataParallel

from parallax.api import build_runner
from parallax.config import Config
from parallax.engine.optimizers.shard_optimizer import as_optimizer_list, parameter_ids
from parallax.engine.tables import handles
from parallax.errors import UnsupportedProgramError, UsageError
from parallax.logs import log
from parallax.model.wrapper import ModuleWrapper
from parallax.runner import Runner
from parallax.verify import record as verify
from parallax.verify.reference import reference_pair

__all__ = ["DistributedModel", "DistributedOptimizer", "GradScaler", "clip_grad_norm_",
           "clip_grad_value_", "distribute"]

# Each parameter of a distributed model knows its runner (weakly): how clip_grad_norm_ finds
# it. An attribute, not a table keyed by id: ids of dead parameters are reused.
_RUNNER_ATTRIBUTE = "_parallax_runner"


def distribute(model: nn.Module,
               optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer], *,
               config: Config | None = None, resources: str | os.PathLike[str] | None = None,
               ) -> tuple[DistributedModel, Any]:
    """The model and optimizer(s) of a data-parallel run of this program (collective: call it
    on every worker). ``optimizer`` is one optimizer or a list; the same shape comes back.

    Launching is as for `parallax.get_runner` (``parallax run``, ``torchrun``, ``resources``
    or a one-worker run in this process); a process group the program initialised itself is
    joined. A DDP program passes its ``DistributedDataParallel`` model: parallax takes the
    module inside (DDP's ``find_unused_parameters`` kept) and the wrapper is retired. Every
    trainable parameter must be in one of the optimizers (on one device a parameter in none
    is never updated; here it would be a silent divergence of the servers' rows, so it is
    refused).

    Example:
        ```python
        model, optimizer = parallax.distribute(model, torch.optim.Adagrad(model.parameters()))
        ```
    """
    optimizers = as_optimizer_list(optimizer)
    if isinstance(model, DistributedDataParallel):  # a DDP program: parallax replaces DDP
        model, config = _retire_ddp(model, config)
    if config is not None and config.parallelism != "data":
        raise UnsupportedProgramError(
            f"parallax.distribute with Config.parallelism={str(config.parallelism)!r}: the "
            f"split layers' parameters are new (DTensor) objects that the program's own loop "
            f"does not hold; train with parallax.get_runner(...).step(batch) instead")
    _refuse_a_second_distribute(model, optimizers)
    _check_every_parameter_optimized(model, optimizers)
    verification = verify.active()
    if verification is not None and verification.role == "reference":  # parallax verify
        timeout = timedelta(seconds=(config or Config()).collective_timeout_s)
        return (reference_pair(verification, model, optimizers, timeout),  # type: ignore[return-value]
                optimizer)
    # The program's random stream goes on as if distribute had not run (dropout masks and
    # every later draw as in the single-device program): nothing seeded, nothing consumed.
    with torch.random.fork_rng(devices=[]):
        runner = build_runner(model, optimizers, _no_loss, resources=resources,
                              config=config, seed=False)
    for opt in optimizers:
        _make_distributed(opt, runner)
    runner.order.enabled = True  # the own loop: every rank must call in the same order
    reference = _RunnerRef(runner)
    for param in model.parameters():
        setattr(param, _RUNNER_ATTRIBUTE, reference)
    distributed = DistributedModel(runner)
    return distributed, (list(optimizers) if isinstance(optimizer, (list, tuple))
                         else optimizers[0])


def _retire_ddp(ddp: DistributedDataParallel,
                config: Config | None) -> tuple[nn.Module, Config | None]:
    """The module inside a DDP program's wrapper, and the `Config` that keeps its
    ``find_unused_parameters``. The wrapper lets go of the parameters (its reducer holds
    them, and its gradient hooks would AllReduce a second time) and refuses to run again:
    parallax synchronises the dense gradients itself (with DDP, inside)."""
    if ddp.find_unused_parameters:
        config = dataclasses.replace(config or Config(), find_unused_parameters=True)
    hooks = [getattr(hook, "__name__", repr(hook)) for hook, _ in getattr(ddp, "_comm_hooks", [])]
    if hooks and (not dist.is_initialized() or dist.get_rank() == 0):
        log.warning(f"parallax: the DDP wrapper's comm hook(s) {hooks} are not used: parallax "
                    f"synchronises the dense gradients itself (Config.dense_sync; the "
                    f"single-device program's exact sums by default; docs/extending.md adds a "
                    f"comm hook of your own as a dense_sync kind)")
    ddp.reducer = None  # type: ignore[assignment]  # its destructor removes its gradient hooks
    ddp.logger = None  # it holds the reducer too
    ddp.forward = _retired_forward  # type: ignore[method-assign]
    return ddp.module, config


def _retired_forward(*args: Any, **kwargs: Any) -> Any:
    raise UnsupportedProgramError(
        "this DistributedDataParallel wrapper was passed to parallax.distribute, which "
        "replaced it: call the model parallax.distribute returned")


class _RunnerRef:
    """A parameter's weak link to its runner that pickles and copies as a dead link (a
    pickled or copied parameter belongs to no run)."""

    def __init__(self, runner: Runner | None) -> None:
        self._ref = weakref.ref(runner) if runner is not None else None

    def __call__(self) -> Runner | None:
        return self._ref() if self._ref is not None else None

    def __reduce__(self) -> tuple[Any, tuple[None]]:
        return (_RunnerRef, (None,))

    def __deepcopy__(self, memo: dict[str, Any]) -> _RunnerRef:
        return _RunnerRef(None)


def clip_grad_norm_(parameters: Iterable[nn.Parameter] | nn.Parameter, max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a distributed model: clips by the L2 norm of the
    *aggregated* gradients, the servers' rows included, as on one device; returns the norm.
    Collective (it pushes the step's gradients if ``optimizer.step()`` has not yet).
    ``error_if_nonfinite``: a NaN or infinite norm raises `NonFiniteError` (a
    ``RuntimeError``, as torch's) on every rank before anything is clipped; ``foreach`` is
    torch's choice of kernel, taken for the plain model and ignored for a distributed one.

    ``torch.nn.utils.clip_grad_norm_`` itself would skip the server-held parameters (it is
    refused on them); on parameters of no distributed model this is torch's own, so the same
    program runs on one device.
    """
    params = _parameter_list(parameters)
    runner = _runner_of(params, "clip_grad_norm_")
    if runner is None:  # a plain model (the single-device run of the same program): torch's
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type,
                                              error_if_nonfinite=error_if_nonfinite,
                                              foreach=foreach)
    if float(norm_type) != 2.0:
        raise UnsupportedProgramError(
            f"parallax.clip_grad_norm_ clips by the L2 norm (norm_type=2.0), got norm_type="
            f"{norm_type!r}")
    return torch.tensor(runner.clip_grad_norm(float(max_norm), params,
                                              error_if_nonfinite=error_if_nonfinite),
                        dtype=torch.float64)


def clip_grad_value_(parameters: Iterable[nn.Parameter] | nn.Parameter, clip_value: float,
                     foreach: bool | None = None) -> None:
    """``torch.nn.utils.clip_grad_value_`` for a distributed model: clamps the *aggregated*
    gradients to ``[-clip_value, clip_value]``, the servers' rows included, as on one device.
    Collective (it pushes the step's gradients if ``optimizer.step()`` has not yet).

    ``torch.nn.utils.clip_grad_value_`` itself would skip the server-held parameters (it is
    refused on them); on parameters of no distributed model this is torch's own, so the same
    program runs on one device.
    """
    params = _parameter_list(parameters)
    runner = _runner_of(params, "clip_grad_value_")
    if runner is None:  # a plain model (the single-device run of the same program): torch's
        torch.nn.utils.clip_grad_value_(params, clip_value, foreach=foreach)
        return
    runner.clip_grad_value(float(clip_value), params)


def _parameter_list(parameters: Iterable[nn.Parameter] | nn.Parameter) -> list[nn.Parameter]:
    """``parameters`` as torch's clipping functions take them: one tensor, or an iterable."""
    if isinstance(parameters, Tensor):  # a tensor, Parameter or not, is one parameter
        return [cast(nn.Parameter, parameters)]
    return list(parameters)


def _runner_of(params: list[nn.Parameter], what: str) -> Runner | None:
    """The runner of the distributed model ``params`` belong to (None: a plain model's);
    refused when they belong to several."""
    runners = {id(r): r for p in params
               if (ref := getattr(p, _RUNNER_ATTRIBUTE, None)) is not None
               and (r := ref()) is not None}
    if len(runners) > 1:
        raise UnsupportedProgramError(
            f"parallax.{what} takes parameters of one model returned by parallax.distribute "
            f"(got parameters of {len(runners)} such model(s)); for other models use "
            f"torch.nn.utils.{what}")
    return next(iter(runners.values()), None)


def _no_loss(output: Any, target: Any) -> Tensor:
    raise UnsupportedProgramError(
        "a model from parallax.distribute computes its loss in your loop: use model(inputs) "
        "and loss.backward(), not Runner.step")


def _refuse_a_second_distribute(model: nn.Module,
                                optimizers: list[torch.optim.Optimizer]) -> None:
    """A model or optimizer that went through `distribute` already (a distribute per epoch,
    or the returned pair passed back) is refused, naming what and the fix."""
    again = ([f"the model ({type(model).__name__})"] if isinstance(model, DistributedModel)
             else [])
    again += [f"the optimizer {type(opt).__name__}" for opt in optimizers
              if isinstance(opt, DistributedOptimizer)]
    if again:
        raise UnsupportedProgramError(
            f"rank {os.environ.get('RANK', '0')}: {' and '.join(again)} went through "
            f"parallax.distribute already (it makes the optimizer you pass the distributed "
            f"one, in place): distribute once, before training, and keep training the model "
            f"and optimizer it returned (a distribute per epoch is not needed)")


def _check_every_parameter_optimized(model: nn.Module,
                                     optimizers: list[torch.optim.Optimizer]) -> None:
    held = parameter_ids(optimizers)
    missing = [name for name, p in model.named_parameters()
               if p.requires_grad and id(p) not in held]
    if missing:
        raise UnsupportedProgramError(
            f"parameter(s) {missing} require gradients but are in none of the optimizers "
            f"given to parallax.distribute; add them to an optimizer, or set "
            f"requires_grad_(False) on them")


def _eagerly(runner: Runner, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The forward of a `DistributedModel` that ``torch.compile`` wraps, run outside the graph
    (dynamo breaks it there): its lookups pull rows by collectives whose sizes change every
    step, which dynamo cannot trace yet. Made disabled only when a compile meets it, so an
    eager step pays no wrapper and no process imports dynamo for it."""
    return runner.forward_call(args, kwargs)


class DistributedModel(ModuleWrapper):
    """The user's module, trained data-parallel: ``forward`` returns what it returns;
    ``state_dict``/``load_state_dict`` are the single-device ones; ``train``/``eval`` and
    attribute access reach the user's module. Parameters are the user's, under the
    single-device names (``named_parameters``: no DDP-style ``module.``, as in ``state_dict``,
    so DCP's ``get_state_dict`` names them as a plain program's); use the optimizer
    `distribute` returned."""

    runner: Runner

    def __init__(self, runner: Runner):
        super().__init__()
        self.module = runner.model
        object.__setattr__(self, "runner", runner)  # not a submodule: no second parameter set

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # (under torch.compile: eagerly, see `_eagerly`)
            return torch.compiler.disable(_eagerly)(self.runner, args, kwargs)
        return self.runner.forward_call(args, kwargs)

    def train(self, mode: bool = True) -> DistributedModel:
        super().train(mode)
        self.runner.module.train(mode)  # the copy that runs
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear every parameter's gradient, the servers' rows included (as
        ``nn.Module.zero_grad`` on one device)."""
        self.runner.zero_grad(set_to_none=set_to_none)

    def _apply(self, fn: Any, recurse: bool = True) -> DistributedModel:
        """``to``/``double``/``cuda``/... after `distribute`: a no-op when nothing would
        change; refused otherwise (the servers' rows would stay as they are)."""
        for name, tensor in [*self.runner.module.named_parameters(),
                             *self.runner.module.named_buffers()]:
            probe = fn(torch.empty(0, dtype=tensor.dtype, device=tensor.device))
            if probe.dtype != tensor.dtype or probe.device != tensor.device:
                raise UnsupportedProgramError(
                    f"rank {self.runner.worker.rank}, {handles.program_line()}: moving or "
                    f"casting the model after "
                    f"parallax.distribute ({name!r}: {tensor.dtype} on {tensor.device} -> "
                    f"{probe.dtype} on {probe.device}) would leave the servers' rows as they "
                    f"are; call .to(...)/.double()/... on the model before "
                    f"parallax.distribute")
        return self

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise UnsupportedProgramError(
            f"{handles.program_line()}: pickling a distributed model (torch.save(model), "
            f"copy.deepcopy) is not supported: its server-held rows are not in this process. "
            f"Save model.state_dict() (collective: on every rank) and rebuild the module from "
            f"it")

    def __deepcopy__(self, memo: dict[str, Any]) -> Any:
        return self.__reduce_ex__(0)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate dense gradients locally in the backwards inside (DDP's ``no_sync``); the
        sparse rows are pushed once per step in any case. Exact either way; saves
        AllReduces when accumulating micro-batches."""
        module = self.runner.module
        with (module.no_sync() if isinstance(module, DistributedDataParallel)
              else contextlib.nullcontext()):
            yield

    def register_comm_hook(self, state: object, hook: Any) -> None:
        """DDP's ``register_comm_hook``: refused, naming the way that works (parallax runs
        the dense sync, `Config.dense_sync`)."""
        raise UnsupportedProgramError(
            f"rank {self.runner.worker.rank}, {handles.program_line()}: register_comm_hook on "
            f"a parallax model: parallax synchronises the dense gradients itself "
            f"(Config.dense_sync: 'hierarchical', 'flat', 'qsgd', ...); a hook of your own "
            f"becomes a dense_sync kind (docs/extending.md, 'A comm hook')")

    @contextlib.contextmanager
    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Iterator[None]:
        """DDP's ``join()`` context for uneven inputs, accepted so that a DDP loop runs as it
        is: every worker must take the same steps (`parallax.shard` gives each the same
        batches), because a worker that ran out would make the global batch one device never
        sees. Inside it as outside, a rank that runs out early is named at the others' next
        step (`UnevenInputsError` once it has ended its training; the own loop's order check
        if it calls something collective instead); nothing is shadowed (DDP's arguments
        change nothing here)."""
        yield

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Tensor]:  # type: ignore[override]
        """The plain single-device ``state_dict`` of the user's module (collective)."""
        if args or kwargs:
            raise UnsupportedProgramError(
                "DistributedModel.state_dict() takes no arguments: it returns the plain "
                "single-device state dict of your module")
        return self.runner.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> Any:
        """Load a single-device ``state_dict`` of the user's module: dense values here, the
        servers' rows on the servers (every worker passes the same values). Optimizer state
        is untouched, as on one device."""
        if assign:
            raise UnsupportedProgramError("DistributedModel.load_state_dict(assign=True) is "
                                          "not supported: the servers keep their own rows")
        return self.runner.load_state_dict(dict(state_dict), strict=strict)


if TYPE_CHECKING:  # a mixin over the user's optimizer class
    _OptimizerBase = torch.optim.Optimizer
else:
    _OptimizerBase = object


class DistributedOptimizer(_OptimizerBase):
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

    def step(self, closure: Any = None) -> Any:
        if hasattr(self, "found_inf"):
            raise UnsupportedProgramError(
                "torch.amp.GradScaler would unscale and check only the replicated gradients, "
                "not the servers' rows: use parallax.GradScaler (the same class, for "
                "distributed optimizers)")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.parallax_runner.apply_update([self])
        return loss

    def parallax_dense_step(self) -> None:
        """The user's optimizer class's own update of the parameters held here (its
        server-held parameters read as gradient-less meta tensors inside)."""
        with handles.internal():
            self.parallax_base.step(self)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.parallax_runner.zero_grad([self], set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The single-device ``state_dict`` (collective: call it on every rank): the
        servers' state of server-held parameters gathered whole."""
        return self.parallax_runner.optimizer_state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a single-device ``state_dict`` (every rank passes the same): the servers
        take their rows of the server-held parameters' state."""
        self.parallax_runner.load_optimizer_state_dict(self, state_dict)


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` for the optimizers of `distribute`: ``unscale_`` (explicit, or
    inside ``step``) also unscales the servers' aggregated rows, and its inf/NaN check covers
    them, one decision on every rank and server; a step it skips ends like a taken one.
    Everything else (``scale``, ``update``, state dicts) is torch's. ``Config.clip_grad_norm``
    does not combine with it: clip with `clip_grad_norm_` after ``unscale_``.

    Example:
        ```python
        scaler = parallax.GradScaler("cpu")
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        parallax.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        ```
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
            raise UsageError("Closure use is not currently supported if GradScaler is "
                               "enabled.")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise UsageError("step() has already been called since the last update().")
        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        result = None
        if not sum(float(v) for v in state["found_inf_per_device"].values()):
            result = optimizer.step(*args, **kwargs)
        else:
            optimizer.parallax_runner.skip_update([optimizer])
        state["stage"] = OptState.STEPPED
        return result


def _make_distributed(optimizer: torch.optim.Optimizer, runner: Runner) -> None:
    """Turn ``optimizer`` itself into an instance of ``Distributed<its class>``: the object
    the program (and its lr schedulers) already hold steps the distributed update, so a
    program that keeps using it after `distribute`, as DDP programs do, trains the same."""
    base = type(optimizer)
    patched = optimizer.__dict__.get("step")
    if patched is not None and not getattr(patched, "_wrapped_by_lr_sched", False):
        raise UnsupportedProgramError(
            f"{base.__name__}.step was replaced on the optimizer object before "
            f"parallax.distribute; the replacement would bypass the distributed update. "
            f"Patch step after parallax.distribute, or subclass the optimizer instead")
    optimizer.__class__ = type(f"Distributed{base.__name__}", (DistributedOptimizer, base),
                               {"parallax_base": base, "__doc__": DistributedOptimizer.__doc__,
                                "__module__": base.__module__})
    optimizer.parallax_runner = runner  # type: ignore[attr-defined]
    if patched is not None:  # an lr scheduler's step counter: it must count our step
        optimizer.step = _counted_step(optimizer)  # type: ignore[method-assign]


def _counted_step(optimizer: torch.optim.Optimizer) -> Any:
    """What ``LRScheduler`` puts on ``optimizer.step`` (it notes that the optimizer stepped),
    around the distributed step."""
    owner = weakref.ref(optimizer)

    def step(*args: Any, **kwargs: Any) -> Any:
        opt = owner()
        if opt is None:
            raise UsageError("the optimizer this lr scheduler steps no longer exists")
        opt._opt_called = True  # type: ignore[attr-defined]  # LRScheduler's own mark
        return type(opt).step(opt, *args, **kwargs)

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    return step
