"""The user's copy of a server-held parameter, released, and what the program may do with it.

Once a parameter's rows live on the servers, the copy in the user's module would only be a
stale full table in every worker process: memory that sharding exists to save. It is released
in place: `torch.utils.swap_tensors` turns the very Parameter object (the one the user's
optimizer and modules hold; ids stay valid) into a `ServerHeldParameter` on the ``meta``
device, with its shape and dtype but no storage; ``runner.state_dict()`` /
``model.state_dict()`` bring the real values back from the servers. A parameter that leaves
the servers (the hybrid's move to AllReduce) gets its values back with `restore`.

The program still holds that object, and a habit of a single-device program that reads it
would compute with nothing, or silently leave the servers' rows out (torch's own
``clip_grad_norm_`` skips a parameter whose ``.grad`` is None). So `ServerHeldParameter`'s
``__torch_function__`` (torch's extension point for tensor subclasses) lets through what is
true without values (shape, dtype, ``requires_grad``, ...), serves what needs only its dtype
and device (``new_zeros``, ``zeros_like``, ``.device``: the worker's device, so
``next(model.parameters()).device`` still says where inputs go), reads the whole value through
the run for an operation that only reads it (a penalty on the table's norm in the loss:
collective, its gradient rows joining the step's push, as on one device), and refuses
everything else called from the user's code (writes, ``.grad``, ``.data``) with an
`UnsupportedProgramError` that names the parameter, the rank, the line of the program and the
fix for the habit it recognises (torch's
``clip_grad_norm_``, ``model.module.zero_grad()``, a manual ``p.data`` update, pickling, a
``state_dict`` of the inner module, ...). Parallax's own code (and torch's code called from
it) sees the plain meta tensor.
"""

from __future__ import annotations

import math
import os
import sys
import sysconfig
import threading
import weakref
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch import Tensor, nn

from parallax.errors import UnsupportedProgramError

__all__ = ["ServerGradient", "ServerHeldParameter", "internal", "is_released", "release",
           "restore"]

# What a storage-less parameter can answer truthfully (attribute getters and size queries).
_METADATA = frozenset({
    "shape", "dtype", "ndim", "requires_grad", "is_leaf", "layout", "names", "grad_fn",
    "is_sparse", "is_meta", "is_cuda", "is_cpu", "is_quantized", "is_nested", "is_mkldnn",
    "size", "dim", "numel", "nelement", "element_size", "__len__", "__repr__", "__format__",
    "__hash__", "is_floating_point", "is_complex", "is_contiguous", "stride",
    "storage_offset", "_is_view", "itemsize", "nbytes", "__class__",
})
# New tensors that take only the handle's dtype (new_*) or dtype and shape (*_like).
_NEW = frozenset({"new_zeros", "new_ones", "new_empty", "new_full", "new_tensor"})
_LIKE = frozenset({"zeros_like", "ones_like", "empty_like", "full_like", "rand_like",
                   "randn_like", "randint_like"})

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_PARALLAX_DIR = str(Path(__file__).resolve().parents[2]) + os.sep  # src/parallax/
_STDLIB_DIR = sysconfig.get_paths()["stdlib"] + os.sep
_state = threading.local()


class internal:  # noqa: N801 (used as a context manager, as contextlib's are)
    """``with internal():`` parallax code running the user's own code over handles (the
    dense step of a user-defined optimizer class): handles answer as plain meta tensors
    inside. (A class, not a generator context: every step enters it.)"""

    def __enter__(self) -> None:
        _state.depth = getattr(_state, "depth", 0) + 1

    def __exit__(self, *exc_info: object) -> None:
        _state.depth -= 1


class ServerHeldParameter(nn.Parameter):
    """A parameter whose rows live on the parameter servers (see the module docstring)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if getattr(_state, "depth", 0):  # parallax's own use (`internal`): first, no name
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        name = _name_of(func)
        passes = (name.removesuffix(".__get__") in _METADATA
                  or name == "grad.__set__" and args[1] is None)
        caller = None if passes else _users_frame()
        if caller is None:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        handle = next(a for a in (*args, *kwargs.values())  # nn.init passes it by keyword
                      if isinstance(a, ServerHeldParameter))
        device = handle.__dict__.get("_parallax_device", torch.device("meta"))
        if name == "device.__get__":
            return device
        if name in _NEW or name in _LIKE:
            template = torch.empty(handle.shape if name in _LIKE else (0,), dtype=handle.dtype,
                                   device=device)
            args = tuple(template if a is handle else a for a in args)
            return func(*args, **kwargs)
        habit = _habit_of(name, caller)  # torch's clip_grad_norm_, zero_grad, ...: refused
        if name == "grad.__get__" and habit is None:
            gradient = _program_gradient(handle)
            if gradient is not None:
                return gradient
        if _only_reads(name) and habit is None:
            wholes = {id(a): whole for a in (*args, *kwargs.values())
                      if isinstance(a, ServerHeldParameter)
                      and (whole := _read_whole(a)) is not None}
            if wholes:  # every handle among the arguments is read through its run
                def value(a: Any) -> Any:
                    return wholes.get(id(a), a) if isinstance(a, ServerHeldParameter) else a
                return func(*map(value, args), **{k: value(v) for k, v in kwargs.items()})
        raise UnsupportedProgramError(_refusal(handle, name, caller))


# in-place scaling by a number, what ``p.grad`` of a server-held parameter allows
_SCALES = {"mul_": False, "__imul__": False, "div_": True, "__itruediv__": True}


class ServerGradient(Tensor):
    """What ``p.grad`` of a server-held parameter answers in the program's code, between its
    backward and ``optimizer.step()``: a storage-less tensor whose in-place scaling by a
    number (``p.grad.div_(k)``, ``p.grad *= c``: gradient accumulation's normalisation)
    scales the parameter's aggregated rows, as on one device (the sum of the workers' scaled
    rows is the scaled sum); anything else is refused as ``.grad`` is (the rows are summed on
    the servers, not held here)."""

    @staticmethod
    def of(handle: Tensor, scale: Any) -> ServerGradient:
        """``handle``'s gradient, ``scale(factor)`` doing its in-place scaling."""
        made = Tensor._make_subclass(ServerGradient, torch.empty_like(handle, device="meta"))
        made.__dict__.update(_parallax_handle=handle, _parallax_scale=scale)
        return made

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = _name_of(func)
        caller = (None if getattr(_state, "depth", 0) or name.removesuffix(".__get__")
                  in _METADATA else _users_frame())
        if caller is None:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        me = args[0] if args and isinstance(args[0], ServerGradient) else None
        if (me is not None and name in _SCALES and len(args) == 2 and not kwargs
                and isinstance(args[1], (int, float, Tensor))
                and (not isinstance(args[1], Tensor) or args[1].numel() == 1)):
            number = float(args[1])
            factor = (1 / number if number else math.inf) if _SCALES[name] else number
            if math.isfinite(factor):  # a non-finite scale is refused, not applied
                me.__dict__["_parallax_scale"](factor)
                return me
        handle = next(a.__dict__["_parallax_handle"] for a in (*args, *kwargs.values())
                      if isinstance(a, ServerGradient))
        raise UnsupportedProgramError(_refusal(handle, "grad.__get__", caller))


def _name_of(func: Any) -> str:
    """``shape.__get__`` for a property's getter, the function's name otherwise."""
    name = getattr(func, "__name__", repr(func))
    if name in ("__get__", "__set__"):
        return f"{getattr(func.__self__, '__name__', '?')}.{name}"
    return name


def _users_frame() -> Any:
    """The first frame outside torch and the standard library that led here, or None when
    that frame is parallax's own."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if not (path.startswith(_TORCH_DIR) or path.startswith(_STDLIB_DIR)
                or path.startswith("<")):
            return None if os.path.abspath(path).startswith(_PARALLAX_DIR) else frame
        frame = frame.f_back
    return None


def program_line() -> str:
    """``file:line`` of the program's own code that led here (the first frame outside
    torch, the standard library and parallax), for messages; "" when there is none."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not (path.startswith(_TORCH_DIR) or path.startswith(_STDLIB_DIR)
                or path.startswith(_PARALLAX_DIR) or frame.f_code.co_filename.startswith("<")):
            return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return ""


def _callers_between(caller: Any) -> set[str]:
    """Names of the functions between the refused operation and the user's frame (torch's
    and the standard library's): what habit the program is in."""
    names = set()
    frame: FrameType | None = sys._getframe(3)
    while frame is not None and frame is not caller:
        names.add(frame.f_code.co_name)
        frame = frame.f_back
    return names


# (functions on the way, or the operation's name) -> what the program does, and the fix
_HABITS: list[tuple[frozenset[str], str, str]] = [
    (frozenset({"clip_grad_value_"}),
     "torch.nn.utils.clip_grad_value_ would skip it (its gradient rows are on the servers)",
     "clip with parallax.clip_grad_value_(model.parameters(), clip_value) (the aggregated "
     "gradients, servers' rows included, as on one device)"),
    (frozenset({"clip_grad_norm_", "get_total_norm", "_get_total_norm"}),
     "torch.nn.utils.clip_grad_norm_ would skip it (its gradient rows are on the servers) "
     "and clip by a different norm",
     "clip with parallax.clip_grad_norm_(model.parameters(), max_norm) (the single-device "
     "global norm, servers' rows included) or Config(clip_grad_norm=...)"),
    (frozenset({"zero_grad"}),
     "zero_grad() of the inner module would leave the servers' gradient rows in place",
     "call zero_grad() on the model parallax.distribute returned, or optimizer.zero_grad()"),
    (frozenset({"_save_to_state_dict", "state_dict"}),
     "a state_dict() of the inner module would hold storage-less meta tensors",
     "call state_dict() on the model parallax.distribute returned, on every rank (it is "
     "collective: it gathers the servers' rows), and save it on one rank"),
    (frozenset({"normal_", "uniform_", "trunc_normal_", "xavier_uniform_", "xavier_normal_",
                "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_", "zeros_",
                "ones_", "constant_", "eye_", "dirac_", "reset_parameters"}),
     "initialising it after parallax.distribute (model.apply(init), nn.init, "
     "reset_parameters) would not reach the servers' rows",
     "initialise the model before parallax.distribute, or load the values after it with "
     "model.load_state_dict(...) (it reaches the servers)"),
    (frozenset({"_apply"}),
     "moving or casting the module after parallax.distribute would leave the servers' rows "
     "as they are",
     "call .to(...)/.double()/... on the model before parallax.distribute"),
    (frozenset({"__reduce_ex__", "__getstate__", "save", "dumps", "dump"}),
     "pickling it (torch.save of the module) would store no values",
     "save model.state_dict() (collective, on every rank) and rebuild the module from it"),
    (frozenset({"__deepcopy__", "deepcopy"}),
     "copying it (copy.deepcopy, AveragedModel) would copy no values",
     "copy the single-device values: m = MyModel(); m.load_state_dict(model.state_dict())"),
    (frozenset({"_unscale_grads_", "unscale_"}),
     "torch.amp.GradScaler would unscale and check only the replicated gradients, not the "
     "servers' rows",
     "use parallax.GradScaler (the same class, for distributed optimizers)"),
    (frozenset({"step", "_init_group"}),
     "an optimizer that parallax.distribute did not return would not update the servers' "
     "rows",
     "step the optimizer parallax.distribute returned (the object you passed becomes it)"),
]
_OPERATIONS = {
    "grad.__get__": (
        "its gradient rows are summed on the servers, not held here",
        "clip with parallax.clip_grad_norm_, update with the optimizer parallax.distribute "
        "returned, clear with model.zero_grad() or optimizer.zero_grad()"),
    "data.__get__": (
        "a manual update (p.data ...) would not reach the servers' rows",
        "update it with a torch.optim optimizer passed to parallax.distribute (the servers "
        "apply that optimizer's update to their rows)"),
    "requires_grad_": (
        "changing requires_grad after parallax.distribute would not stop the servers' update",
        "set requires_grad before parallax.distribute"),
    "requires_grad.__set__": (
        "changing requires_grad after parallax.distribute would not stop the servers' update",
        "set requires_grad before parallax.distribute"),
}


# operations a penalty on the parameters in the loss applies (an L2 or L1 term)
_PENALTIES = frozenset({"pow", "__pow__", "square", "norm", "linalg_vector_norm", "abs",
                        "__abs__", "mul", "__mul__", "__rmul__", "sum"})


# in-place operators: a write, which would not reach the servers' rows
_WRITES = frozenset({"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                     "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__",
                     "__irshift__", "__imatmul__", "__setitem__", "__delitem__"})


def _only_reads(operation: str) -> bool:
    """Whether ``operation`` only reads the tensor's values (no in-place op, no setter, none
    of the accesses `_OPERATIONS` refuses)."""
    in_place = operation.endswith("_") and not operation.startswith("__")
    return not (in_place or operation in _WRITES or operation.endswith(".__set__")
                or operation in _OPERATIONS)


def _habit_of(operation: str, caller: Any) -> tuple[str, str] | None:
    """The habit of `_HABITS` the program is in (its what and fix), if any."""
    on_the_way = _callers_between(caller) | {operation}
    return next(((w, f) for names, w, f in _HABITS if names & on_the_way), None)


def _runners() -> list[Any]:
    """The current run's runners (`parallax.runs`)."""
    from parallax import runs

    run = runs.current_run()
    return run.runners() if run is not None else []


def _program_gradient(handle: ServerHeldParameter) -> ServerGradient | None:
    """``handle``'s `ServerGradient` from the runner of the current run that holds it, where
    that runner can scale it now; None otherwise."""
    for runner in _runners():
        gradient: ServerGradient | None = runner.program_gradient(handle)
        if gradient is not None:
            return gradient
    return None


def _read_whole(handle: ServerHeldParameter) -> Tensor | None:
    """The parameter's whole value read through the runner of the current run that holds it
    (collective; with autograd its gradient rows join the step's push), or None."""
    for runner in _runners():
        whole: Tensor | None = runner.read_whole(handle)
        if whole is not None:
            return whole
    return None


def _refusal(handle: ServerHeldParameter, operation: str, caller: Any) -> str:
    name = handle.__dict__.get("_parallax_name", "?")
    rank = handle.__dict__.get("_parallax_rank", "?")
    on_the_way = _callers_between(caller) | {operation}
    what, fix = next(((w, f) for names, w, f in _HABITS if names & on_the_way), (None, None))
    if what is None:
        what, fix = _OPERATIONS.get(operation, (
            "its values are not on this rank",
            "compute from the model's outputs, or read the single-device values with "
            "model.state_dict() (collective, on every rank)"))
        if operation in _PENALTIES:
            fix += ("; for a penalty on the parameters in the loss (L2: lam * p.pow(2).sum()) "
                    "give the optimizer weight_decay=2*lam instead: torch.optim.SGD, Adam "
                    "and Adagrad add the same gradient (AdamW's decoupled decay is another "
                    "update)")
    where = f"{caller.f_code.co_filename}:{caller.f_lineno}"
    op = operation.replace(".__get__", "").replace(".__set__", " =")
    return (f"rank {rank}: parameter {name!r} lives on the parameter servers (parallax), so "
            f"{op!r} on it at {where} cannot run here: {what}. Fix: {fix}.")


def release(param: nn.Parameter, *, name: str | None = None,
            device: torch.device | None = None, rank: int | None = None) -> None:
    """Drop ``param``'s storage, keeping the object, its shape, dtype and requires_grad; it
    becomes a `ServerHeldParameter` named ``name`` (in messages) whose ``.device`` reads
    ``device`` in the user's code. A parameter something holds a weak reference to
    (``nn.LSTM`` keeps its flat weights so) cannot be swapped and keeps its storage: only
    dense layers under ps/optps are such."""
    if is_released(param) or weakref.getweakrefcount(param):
        return
    handle = ServerHeldParameter(torch.empty_like(param, device="meta"),
                                 requires_grad=param.requires_grad)
    _swap(param, handle)
    param.__dict__.update(_parallax_name=name or "?", _parallax_rank="?" if rank is None else rank,
                          _parallax_device=device or torch.device("cpu"))


def restore(param: nn.Parameter, values: Tensor) -> None:
    """Give ``param`` ``values`` (and the storage a released one had none of; same object)."""
    if not is_released(param):
        with torch.no_grad():
            param.copy_(values.reshape(param.shape))
        return
    full = nn.Parameter(values.detach().reshape(param.shape).to(param.dtype).clone(),
                        requires_grad=param.requires_grad)
    _swap(param, full)
    for key in ("_parallax_name", "_parallax_rank", "_parallax_device"):
        param.__dict__.pop(key, None)


def is_released(param: Tensor) -> bool:
    return param.device.type == "meta"


def _swap(param: nn.Parameter, other: nn.Parameter) -> None:
    """``param`` takes ``other``'s data and class and keeps its own Python attributes
    (swap_tensors swaps ``__dict__`` too; e.g. the partition-group tag lives there)."""
    attributes = dict(param.__dict__)
    torch.utils.swap_tensors(param, other)
    param.__dict__.update(attributes)
