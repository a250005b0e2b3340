"""What a ``torch.fx`` trace read of the modules' Python state, so a trace is used only while
that state holds.

A trace runs ``forward``'s Python once and keeps only the tensor operations: every branch on a
flag (``if self.training:``), every number read off a module (``self.scale``) is fixed at its
value then. A module tree traced in training mode and run in eval mode would silently compute
the training branch. `recording` watches a trace: every plain value (bool, int, float, str,
None) any traced module's attribute gave, and every attribute the trace wrote (undone after
it: tracing must not change the program's modules), the registered buffers and parameters
too: a buffer the forward updates in place with constants (``self.steps += 1``) is updated
for real by a trace, and one it reassigns is left holding an fx ``Proxy``; both are put
back. `Reads.hold` then says whether the
modules still give those values; `TraceCache` keeps one trace per state seen and makes a new
one when none holds (`parallax.model.stand_ins.RetracedRoot`, the id look-ahead of
`parallax.step.forward`).

Written here because ``torch.fx`` has no record of the Python values a trace read (its
``Tracer.getattr`` hook sees parameters, buffers and submodules only).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch
from torch import Tensor, nn

__all__ = ["Reads", "TraceCache", "note", "recording", "same_traced"]

logger = logging.getLogger("parallax")

_PLAIN = (bool, int, float, str, type(None))
_MISSING = object()
_active: list[Reads] = []  # the recordings under way (innermost last)
_subclasses: dict[type, type] = {}
_LOGGED = 3  # traces of one cache logged (info)
_COSTLY = 20  # a cache traced this often warns once


@dataclass(eq=False)
class Reads:
    """The plain values a trace read off modules (first value per module and attribute), and
    the attributes it wrote (``(module, name)``, in order)."""

    entries: dict[tuple[int, str], tuple[nn.Module, str, Any]] = field(default_factory=dict)
    writes: list[tuple[nn.Module, str]] = field(default_factory=list)

    @property
    def program_writes(self) -> list[tuple[nn.Module, str]]:
        """The writes of the program's ``forward`` (not fx's own tensor constants)."""
        return [(m, n) for m, n in self.writes if not n.startswith("_tensor_constant")]

    def hold(self) -> bool:
        """Whether every module still gives the value the trace read."""
        return all(_same(_attribute(module, name), value)
                   for module, name, value in self.entries.values())

    def add(self, module: nn.Module, name: str, value: Any) -> None:
        self.entries.setdefault((id(module), name), (module, name, value))

    def common(self, other: Reads) -> Reads:
        """The reads both made with the same value (what two equal traces depend on)."""
        return Reads({key: entry for key, entry in self.entries.items()
                      if key in other.entries and _same(other.entries[key][2], entry[2])})

    def describe(self) -> str:
        return ", ".join(f"{type(m).__name__}.{n}={v!r}" for m, n, v in self.entries.values()
                         if not n.startswith("_"))


def _attribute(module: nn.Module, name: str) -> Any:
    try:
        return object.__getattribute__(module, name)
    except AttributeError:
        return _MISSING


def _same(now: Any, then: Any) -> bool:
    if type(now) is not type(then):
        return False
    if isinstance(then, float) and math.isnan(then):
        return math.isnan(now)
    return bool(now == then)


def note(reads: Reads) -> None:
    """Count ``reads`` as read by the recordings under way (a module that chooses among traces
    by them, while itself traced)."""
    for active in _active:
        for module, name, value in reads.entries.values():
            active.add(module, name, value)


def _recording_class(cls: type) -> type:
    """``cls`` with attribute reads and writes reported to the recordings under way; the same
    module and name, so that fx's rule for leaf modules (by ``__module__``) sees ``cls``."""
    base: Any = cls  # (its own __getattribute__ and __setattr__, whatever they are)
    if cls not in _subclasses:
        def __getattribute__(self: nn.Module, name: str) -> Any:
            value = base.__getattribute__(self, name)
            if _active and isinstance(value, _PLAIN) and not name.startswith("__"):
                for active in _active:
                    active.add(self, name, value)
            return value

        def __setattr__(self: nn.Module, name: str, value: Any) -> None:
            for active in _active:
                active.writes.append((self, name))
            base.__setattr__(self, name, value)

        _subclasses[cls] = type(cls.__name__, (cls,), {
            "__getattribute__": __getattribute__, "__setattr__": __setattr__,
            "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    return _subclasses[cls]


@contextlib.contextmanager
def recording(model: nn.Module, traced_into: Callable[[nn.Module, str], bool]) -> Iterator[Reads]:
    """Record what a trace of ``model`` inside this block reads and writes on the modules it
    runs the Python of (``traced_into(module, qualified name)``: the tracer's non-leaves).
    What it wrote is set back afterwards, fx's tensor constants on the root too: make the
    ``GraphModule`` (which takes its own copy of them) inside the block."""
    reads = Reads()
    swapped: list[tuple[nn.Module, type]] = []
    before: dict[tuple[int, str], tuple[nn.Module, str, Any]] = {}
    for path, module in model.named_modules():
        cls = type(module)
        if not traced_into(module, path):
            continue
        try:  # (a class with its own metaclass, a scripted module: not watched)
            object.__setattr__(module, "__class__", _recording_class(cls))
        except Exception as error:  # (any refusal: the module is left as it is)
            logger.debug("parallax: %s not watched while traced: %s", cls.__name__, error)
            continue
        swapped.append((module, cls))
        before.update({(id(module), k): (module, k, v) for k, v in module.__dict__.items()})
    kept = _TensorState(model)
    _active.append(reads)
    try:
        yield reads
    finally:
        kept.restore()
        del _active[next(i for i, r in enumerate(_active) if r is reads)]
        for module, cls in swapped:
            object.__setattr__(module, "__class__", cls)
        for module, name in reads.writes:  # the trace's writes undone
            old = before.get((id(module), name))
            if old is not None:
                object.__setattr__(module, name, old[2])
            elif name in module.__dict__:
                del module.__dict__[name]


class _TensorState:
    """Every module's registered buffers (the objects, and their values) and parameters (the
    objects) under ``model``, to put back after a trace ran its ``forward``'s Python. A value
    is copied back only where the trace changed it (its version counter moved)."""

    def __init__(self, model: nn.Module) -> None:
        self.entries: list[tuple[dict[str, Any], str, Any, int, Tensor | None]] = []
        for module in model.modules():
            for table in (module._buffers, module._parameters):
                for name, tensor in table.items():
                    saved = (tensor.detach().clone()
                             if table is module._buffers and isinstance(tensor, Tensor)
                             and tensor.device.type != "meta" else None)
                    version = tensor._version if isinstance(tensor, Tensor) else 0
                    self.entries.append((table, name, tensor, version, saved))

    def restore(self) -> None:
        with torch.no_grad():
            for table, name, tensor, version, saved in self.entries:
                if table.get(name) is not tensor:
                    table[name] = tensor
                if saved is not None and tensor._version != version:
                    tensor.copy_(saved)


def same_traced(a: nn.Module, b: nn.Module) -> bool:
    """Two ``fx.GraphModule`` traces that compute alike: the same code, and the same tensor
    constants (a trace keeps a tensor it made from a module's value as an attribute of its
    own, which its code only names)."""
    if getattr(a, "code", None) != getattr(b, "code", ...):
        return False
    mine, theirs = _own_tensors(a), _own_tensors(b)
    return mine.keys() == theirs.keys() and all(
        mine[k].dtype == theirs[k].dtype and mine[k].shape == theirs[k].shape
        and torch.equal(mine[k], theirs[k]) for k in mine)


def _own_tensors(module: nn.Module) -> dict[str, Tensor]:
    """A trace's tensors of its own (fx registers its constants as buffers), not its
    children's."""
    return {**{k: v for k, v in module.__dict__.items() if isinstance(v, Tensor)},
            **{k: v for k, v in module._buffers.items() if v is not None}}


T = TypeVar("T")


class TraceCache(Generic[T]):
    """Traces (``make()``: the thing made and what its trace read) kept per state of the
    modules: `get` returns one whose reads hold, making a new one when none does (at most
    ``size`` kept, the least recently used dropped). A new trace ``same`` as a kept one
    (the same code) shows that the values in which their reads differ did not matter: the
    kept one stays, depending only on the values both read alike (a call counter read by
    ``forward`` costs one trace more, not one per call)."""

    def __init__(self, make: Callable[[], tuple[T, Reads]], *, what: str,
                 same: Callable[[T, T], bool] = lambda a, b: False, size: int = 8):
        self.make = make
        self.same = same
        self.what = what
        self.size = size
        self.entries: list[tuple[Reads, T]] = []
        self.made = 0

    def get(self) -> T:
        for i, (reads, made) in enumerate(self.entries):
            if reads.hold():
                if i:
                    self.entries.insert(0, self.entries.pop(i))
                note(reads)
                return made
        made, reads = self.make()
        self.made += 1
        for i, (kept_reads, kept) in enumerate(self.entries):
            if self.same(kept, made):
                self.entries[i] = (kept_reads.common(reads), kept)
                note(self.entries[i][0])
                return kept
        if 1 < self.made <= _LOGGED:
            logger.info("parallax: %s traced again (trace %d): the Python values it read "
                        "changed (%s)", self.what, self.made, reads.describe() or "-")
        elif self.made == _COSTLY:
            logger.warning("parallax: %s traced %d times: a value it reads keeps changing "
                           "(%s); each change costs a trace of forward. Pass such a value "
                           "as an argument of forward instead", self.what, self.made,
                           reads.describe() or "-")
        self.entries.insert(0, (reads, made))
        del self.entries[self.size:]
        note(reads)
        return made

    def seed(self, made: T, reads: Reads) -> None:
        """Keep an already made trace."""
        self.entries.insert(0, (reads, made))
        self.made += 1
