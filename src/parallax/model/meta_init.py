"""Building a model without materialising its large tensors: `parallax.meta_init`.

Inside ``with parallax.meta_init():`` a CPU tensor factory (``torch.empty``, ``zeros``, ``ones``,
``full``, ``rand``, ``randn``) that would create at least ``threshold_bytes`` creates a
storage-less tensor on the ``meta`` device instead, and what initialises it is recorded as a
*recipe*: the factory's fill, then every in-place initialisation applied to it (``normal_``,
``uniform_``, ``fill_``, ``zero_``, ``mul_``/``div_``/``add_``/``sub_`` by a number, ``clamp_``,
``erfinv_``: what ``nn.init``'s ``normal_``, ``uniform_``, ``trunc_normal_``, ``xavier_*``,
``kaiming_*``, ``constant_``/``zeros_``/``ones_`` and ``nn.Embedding``'s padding row do), with
the state of the random generator a random step draws from. The generator is advanced as the
real call would advance it (the numbers are drawn, chunk by chunk, and dropped), so everything
initialised afterwards draws exactly what the single-device program draws.

parallax then gives each server its own rows (`Recipe.rows`) and a worker that keeps a
parameter whole its values (`Recipe.materialise`) by replaying the recipe over the table in
chunks of rows: memory of one chunk plus the rows kept, never the whole table.

Why the replay is bitwise exact: torch's CPU ``uniform_`` draws one number per element, in
order; CPU ``normal_`` draws uniforms and turns them into normals 16 at a time (Box-Muller),
re-drawing the last 16 when the count is not a multiple of 16 (a tensor of fewer than 16
elements takes another path). Chunks of a multiple of 16 elements, the last one holding at
least 16, therefore draw the same numbers as one call over the whole tensor
(tests/unit/test_meta_init.py checks this bitwise for every dtype and step listed above).

Anything else done to a deferred tensor in place (``copy_`` from a loaded tensor,
``nn.init.orthogonal_``, ``sparse_``, a random step on part of a tensor, a random step on
another device's generator) cannot be replayed row by row and raises `UnsupportedProgramError`
at the call, naming the operation.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from parallax.engine.optimizers.shard_optimizer import (
    rebuild_constructor_state,
    state_to_params_device,
)
from parallax.engine.tables.handles import restore
from parallax.errors import ArgumentError, UnsupportedProgramError

__all__ = ["Recipe", "meta_init", "recipe_of"]

_CHUNK_ELEMENTS = 1 << 20  # per replayed chunk (4 MiB of float32)
_aten = torch.ops.aten
# factory -> how it fills (None: torch.empty, no values)
_FACTORIES = {_aten.empty.memory_format: None, _aten.zeros.default: ("fill", 0),
              _aten.ones.default: ("fill", 1), _aten.full.default: ("full", None),
              _aten.rand.default: ("uniform_", None), _aten.rand.generator: ("uniform_", None),
              _aten.randn.default: ("normal_", None), _aten.randn.generator: ("normal_", None)}
_RANDOM = {"normal_", "uniform_"}
_ELEMENTWISE = {"fill_", "zero_", "mul_", "div_", "add_", "sub_", "clamp_", "clamp_min_",
                "clamp_max_", "erfinv_", "copy_"}  # copy_: of a number (t[i] = 0.5)
_OUT_OF_PLACE = {"mul", "div", "add", "sub", "_to_copy"}  # _to_copy: model.double() etc.


@dataclass
class _Step:
    """One recorded initialisation, replayed on a chunk of rows: ``call(chunk, generator)``
    returns the chunk's new values (in place, or a new tensor for out-of-place steps)."""

    call: Callable[[Tensor, torch.Generator | None], Tensor]
    what: str
    rows: tuple[int, int] | None = None  # a row range of the tensor; None: the whole tensor
    rng_state: Tensor | None = None  # a random step: its generator's state when it ran


@dataclass
class Recipe:
    """How a deferred tensor's values come about; replayable over any rows."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    start_dtype: torch.dtype  # dtype of the factory's tensor (out-of-place steps may change it)
    steps: list[_Step] = field(default_factory=list)
    holder: Tensor | None = None  # keeps the meta storage, whose identity is the key, alive

    @property
    def num_rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def row_shape(self) -> tuple[int, ...]:
        return self.shape[1:] if self.shape else ()

    def describe(self) -> str:
        return " -> ".join(step.what for step in self.steps) or "torch.empty (never initialised)"

    def chunks(self) -> list[tuple[int, int]]:
        """Row ranges replayed one at a time: each a multiple of 16 elements (the last may be
        longer), so random steps draw exactly what one call over the tensor draws."""
        row_elements = max(1, math.prod(self.row_shape))
        unit = 16 // math.gcd(row_elements, 16)
        rows = max(unit, _CHUNK_ELEMENTS // row_elements // unit * unit)
        bounds = [*range(0, self.num_rows, rows), self.num_rows]
        if len(bounds) > 2 and (bounds[-1] - bounds[-2]) * row_elements < 16:
            bounds.pop(-2)
        return list(zip(bounds[:-1], bounds[1:], strict=True))

    def _replay(self) -> Iterator[tuple[int, int, Tensor]]:
        if not self.steps:
            raise UnsupportedProgramError(
                "a tensor built inside parallax.meta_init() with torch.empty was never "
                "initialised: its single-device values are undefined, so parallax cannot "
                "reproduce them; initialise it (e.g. nn.init.normal_) inside the context")
        generators = {}
        for index, step in enumerate(self.steps):
            if step.rng_state is not None:
                generators[index] = torch.Generator()
                generators[index].set_state(step.rng_state)
        for start, stop in self.chunks():
            chunk = torch.empty((stop - start, *self.row_shape), dtype=self.start_dtype)
            for index, step in enumerate(self.steps):
                if step.rows is None:
                    chunk = step.call(chunk, generators.get(index))
                    continue
                low, high = max(start, step.rows[0]), min(stop, step.rows[1])
                if low < high:
                    step.call(chunk[low - start:high - start], None)
            yield start, stop, chunk

    def rows(self, ids: Tensor) -> Tensor:
        """The values rows ``ids`` (global, any order) have in the single-device program,
        replayed chunk by chunk: only those rows and one chunk are ever in memory."""
        ids = ids.reshape(-1).to(torch.long)
        out = torch.empty((ids.numel(), *self.row_shape), dtype=self.dtype)
        order = torch.argsort(ids)
        ordered = ids[order]
        with torch.no_grad():
            for start, stop, chunk in self._replay():
                low, high = torch.searchsorted(ordered, torch.tensor([start, stop])).tolist()
                if low < high:
                    out[order[low:high]] = chunk[ordered[low:high] - start].to(self.dtype)
        return out if self.shape else out.reshape(())

    def materialise(self) -> Tensor:
        """The whole tensor's values (for a parameter a worker keeps whole)."""
        return self.rows(torch.arange(self.num_rows)).reshape(self.shape)


# By the meta storage's identity (views and Parameters share it). Each entry holds its storage
# (a meta storage owns no memory), so that no later tensor of this process, a later run's,
# can be given its address and read an earlier tensor's recipe.
_recipes: dict[int, Recipe] = {}
_held: dict[int, torch.UntypedStorage] = {}


def _key(tensor: Tensor) -> int:
    return int(tensor.untyped_storage()._cdata)


def _keep(tensor: Tensor, recipe: Recipe) -> None:
    """``tensor``'s recipe, its storage held with it."""
    key = _key(tensor)
    _recipes[key] = recipe
    _held[key] = tensor.untyped_storage()


def recipe_of(tensor: Tensor) -> Recipe | None:
    """The recipe of a tensor built inside `meta_init` (the whole tensor, e.g. a Parameter
    wrapping it); None for any other tensor."""
    if not isinstance(tensor, Tensor) or tensor.device.type != "meta":
        return None
    recipe = _recipes.get(_key(tensor))
    if recipe is None or tensor.storage_offset() != 0 or tuple(tensor.shape) not in (
            recipe.shape, (1,) if recipe.shape == () else recipe.shape):
        return None
    return recipe


def forget(tensor: Tensor) -> None:
    """Drop ``tensor``'s recipe (its values now live elsewhere)."""
    if tensor.device.type == "meta":
        key = _key(tensor)
        _recipes.pop(key, None)
        _held.pop(key, None)


def place_on_device(model: nn.Module, server_held: Iterable[str],
                    optimizers: Sequence[torch.optim.Optimizer], device: torch.device) -> None:
    """A training run's start: what ``model`` built in `meta_init` keeps on every worker gets
    its values now (the ``server_held`` parameters stay storage-less: each server makes its
    own rows; the optimizers' constructor-time state is rebuilt for the others), then the
    model moves to ``device`` in place (the optimizers' Parameter objects stay the same)."""
    for param in materialise_kept(model, server_held):
        rebuild_constructor_state(optimizers, param)
    model._apply(lambda t: t if t.device.type == "meta" else t.to(device))
    state_to_params_device(optimizers)  # Adagrad's sums were made where the model was built


def materialise_kept(model: nn.Module, deferred_ok: Iterable[str]) -> list[nn.Parameter]:
    """Give real values to every tensor of ``model`` built in `meta_init` except the
    parameters named in ``deferred_ok`` (those the servers will hold; their recipes stay for
    the tables). Returns the parameters materialised. Raises `UnsupportedProgramError` for a
    meta tensor parallax cannot give values (built under ``torch.device("meta")`` alone)."""
    keep = set(deferred_ok)
    done = []
    # nn.RNN/LSTM/GRU hold weak references to their weights, which torch.utils.swap_tensors
    # refuses: dropped here, rebuilt by the module's own _init_flat_weights below.
    rnns = [m for m in model.modules() if isinstance(m, nn.RNNBase)
            and any(p.device.type == "meta" for p in m.parameters(recurse=False))]
    for rnn in rnns:
        rnn._flat_weight_refs = []
    for name, param in model.named_parameters():
        if param.device.type != "meta":
            continue
        recipe = _recipe_or_raise(name, param)
        if name not in keep:
            _restore(param, recipe)
            done.append(param)
    for rnn in rnns:
        rnn._init_flat_weights()
    for module_name, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and buffer.device.type == "meta":
                full = f"{module_name}.{name}" if module_name else name
                recipe = _recipe_or_raise(full, buffer)
                module._buffers[name] = recipe.materialise().to(buffer.dtype)
                forget(buffer)
    return done


def _recipe_or_raise(name: str, tensor: Tensor) -> Recipe:
    recipe = recipe_of(tensor)
    if recipe is None:
        raise UnsupportedProgramError(
            f"'{name}' is on the meta device with no values parallax can reproduce (a model "
            "built under torch.device('meta') alone, or one an earlier parallax run released). "
            "Build the model inside `with parallax.meta_init():` so that parallax records its "
            "initialisation, or build it normally")
    return recipe


def _restore(param: nn.Parameter, recipe: Recipe) -> None:
    restore(param, recipe.materialise())
    if recipe.holder is not None:
        forget(recipe.holder)


def _deferred(value: Any) -> Recipe | None:
    if isinstance(value, Tensor) and value.device.type == "meta":
        return _recipes.get(_key(value))
    return None


def _refuse(what: str, why: str) -> UnsupportedProgramError:
    return UnsupportedProgramError(
        f"parallax.meta_init(): {what} on a deferred tensor cannot be reproduced row by row "
        f"({why}). Build this tensor outside the context (or raise threshold_bytes above its "
        "size), or load its values after construction (runner.load_state_dict, a checkpoint)")


class meta_init:  # noqa: N801 - a context manager, named like torch.no_grad
    """``with parallax.meta_init(): model = Model()`` builds ``model`` with every CPU tensor
    of at least ``threshold_bytes`` on the ``meta`` device, its initialisation recorded
    (module docstring). Passed to `parallax.distribute` / `get_runner`, each server
    materialises only its own rows of a server-held table, bitwise equal to what the
    single-device program's initialisation gives; a parameter every worker keeps whole is
    materialised whole at start-up. Seed every worker alike, as without it."""

    def __init__(self, threshold_bytes: int = 1 << 20):
        if threshold_bytes < 0:
            raise ArgumentError(f"threshold_bytes must be >= 0, got {threshold_bytes}")
        self.threshold_bytes = threshold_bytes
        self._modes: list[Any] = []

    def __enter__(self) -> meta_init:
        self._modes = [_LooksReal(), _Deferring(self.threshold_bytes)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._modes = []


class _LooksReal(TorchFunctionMode):
    """``is_meta`` is False for a deferred tensor: nn.init's ``trunc_normal_``,
    ``orthogonal_``, ``sparse_`` and ``dirac_`` skip meta tensors silently; this way they
    run, and `_Deferring` records or refuses what they do."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if getattr(func, "__self__", None) is _IS_META and args and _deferred(args[0]) is not None:
            return False
        return func(*args, **(kwargs or {}))


_IS_META = torch._C.TensorBase.__dict__["is_meta"]  # its __get__ is the func seen


class _Deferring(TorchDispatchMode):
    """Creates the large factories' tensors on ``meta`` and records what initialises them."""

    def __init__(self, threshold_bytes: int):
        super().__init__()  # type: ignore[no-untyped-call]  # (torch's is unannotated)
        self.threshold_bytes = threshold_bytes
        # meta scalar tensors made in the context (``t[i] = 0.5`` copies scalar_tensor(0.5),
        # made on ``meta`` beside its target): their numbers
        self._constants: dict[int, tuple[Any, Tensor]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _FACTORIES:
            return self._factory(func, args, kwargs)
        if func is _aten.scalar_tensor.default:
            result: Tensor = func(*args, **kwargs)
            if result.device.type == "meta":
                self._constants[_key(result)] = (args[0], result)  # result: no key reuse
            return result
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense" and args[0].device.type == "meta":
            raise _refuse("reading a value (.item(), a data-dependent branch such as "
                          "trunc_normal_'s rejection loop)", "its values do not exist yet")
        written = [a for a, spec in zip(args, func._schema.arguments, strict=False)
                   if spec.alias_info is not None and spec.alias_info.is_write]
        written += [v for k, v in kwargs.items() if k == "out"]
        target = _deferred(args[0]) if args else None
        if target is not None and written and written[0] is args[0]:
            if name in _RANDOM:
                return self._random(func, args, kwargs, target)
            if name in _ELEMENTWISE:
                return self._elementwise(func, args, kwargs, target)
            raise _refuse(f"{func}", "only normal_, uniform_ and elementwise steps by numbers "
                                     "replay")
        if any(_deferred(w) is not None for w in written):
            raise _refuse(f"{func}", "it writes into the tensor")
        if target is not None and name in _OUT_OF_PLACE:
            return self._out_of_place(func, args, kwargs, target)
        view: Tensor = func(*args, **kwargs)  # views, shapes: no values needed
        return view

    def _factory(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor:
        device = kwargs.get("device")
        if device is not None and torch.device(device).type != "cpu":
            result: Tensor = func(*args, **kwargs)
            return result
        shaped: Tensor = func(*args, **{**kwargs, "device": torch.device("meta")})
        if shaped.numel() * shaped.element_size() < self.threshold_bytes:
            small: Tensor = func(*args, **kwargs)
            return small
        recipe = Recipe(tuple(shaped.shape), shaped.dtype, shaped.dtype, holder=shaped)
        fill = _FACTORIES[func]
        if fill is not None:
            kind, value = fill
            if kind == "full":
                kind, value = "fill", args[1]
            if kind == "fill":
                recipe.steps.append(_Step(functools.partial(_fill, value=value),
                                          f"fill({value})"))
            else:
                generator = kwargs.get("generator")
                step = _random_step(getattr(_aten, kind).default, (), {}, generator)
                recipe.steps.append(step)
                _advance(recipe, step, generator)
        _keep(shaped, recipe)
        return shaped

    def _random(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                recipe: Recipe) -> Tensor:
        target: Tensor = args[0]
        if _rows_of(target, recipe) != (0, recipe.num_rows) or target.numel() != math.prod(
                recipe.shape):
            raise _refuse(f"{func} on part of the tensor",
                          "a random step replays on whole tensors only")
        generator = kwargs.get("generator")
        if generator is not None and generator.device.type != "cpu":
            raise _refuse(f"{func} with a {generator.device} generator",
                          "only the CPU generator's stream is reproduced")
        rest = {k: v for k, v in kwargs.items() if k != "generator"}
        step = _random_step(func, args[1:], rest, generator)
        recipe.steps.append(step)
        _advance(recipe, step, generator)
        return target

    def _elementwise(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                     recipe: Recipe) -> Tensor:
        target: Tensor = args[0]
        rows = _rows_of(target, recipe)
        extra, named = self._scalars(func, args[1:], kwargs)
        recipe.steps.append(_Step(functools.partial(_apply_op, func=func, args=extra,
                                                    kwargs=named),
                                  _describe(func, extra),
                                  None if rows == (0, recipe.num_rows) else rows))
        return target

    def _scalars(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                 ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``args``/``kwargs`` as numbers; refuses tensors (their values do not replay)."""
        def number(value: Any) -> Any:
            if isinstance(value, Tensor):
                if value.device.type == "meta" and _key(value) in self._constants:
                    return self._constants[_key(value)][0]
                if value.device.type == "meta" or value.dim() != 0:
                    raise _refuse(f"{func} by a tensor", "only numbers replay")
            return value
        return tuple(number(a) for a in args), {k: number(v) for k, v in kwargs.items()}

    def _out_of_place(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                      recipe: Recipe) -> Tensor:
        if _rows_of(args[0], recipe) != (0, recipe.num_rows):
            raise _refuse(f"{func} of part of the tensor", "only whole tensors replay")
        extra, named = self._scalars(func, args[1:], kwargs)
        result: Tensor = func(*args, **kwargs)
        step = _Step(functools.partial(_apply_op, func=func, args=extra, kwargs=named),
                     _describe(func, extra))
        _keep(result, Recipe(tuple(result.shape), result.dtype, recipe.start_dtype,
                             [*recipe.steps, step], holder=result))
        return result


def _describe(func: Any, args: tuple[Any, ...]) -> str:
    shown = [a.item() if isinstance(a, Tensor) else a for a in args]
    return f"{func.overloadpacket.__name__}({', '.join(map(repr, shown))})"


def _random_step(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                 generator: torch.Generator | None) -> _Step:
    state = (generator or torch.default_generator).get_state()
    return _Step(functools.partial(_apply_random_op, func=func, args=args, kwargs=kwargs),
                 _describe(func, args), rng_state=state)


def _fill(chunk: Tensor, generator: torch.Generator | None, *, value: Any) -> Tensor:
    """A recorded ``fill_`` (``full``, ``ones``, ``zeros``...) on ``chunk``."""
    return chunk.fill_(value)


def _apply_op(chunk: Tensor, generator: torch.Generator | None, *, func: Any,
              args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor:
    """A recorded deterministic op on ``chunk``."""
    result: Tensor = func(chunk, *args, **kwargs)
    return result


def _apply_random_op(chunk: Tensor, generator: torch.Generator | None, *, func: Any,
                     args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor:
    """A recorded random op on ``chunk``, drawing from ``generator``."""
    result: Tensor = func(chunk, *args, generator=generator, **kwargs)
    return result


def _advance(recipe: Recipe, step: _Step, generator: torch.Generator | None) -> None:
    """Draw, chunk by chunk, the numbers ``step`` takes from ``generator`` (the default one
    when None), so the stream continues where the single-device program's does."""
    gen = generator or torch.default_generator
    with torch.no_grad():
        for start, stop in recipe.chunks():
            step.call(torch.empty((stop - start, *recipe.row_shape), dtype=recipe.dtype), gen)


def _rows_of(view: Tensor, recipe: Recipe) -> tuple[int, int] | None:
    """The row range ``view`` covers of its deferred base, when it is whole contiguous rows."""
    row_elements = max(1, math.prod(recipe.row_shape))
    offset, count = view.storage_offset(), view.numel()
    if not view.is_contiguous() or offset % row_elements or count % row_elements:
        raise _refuse("a step on a part that is not whole rows", "steps replay on row ranges")
    return offset // row_elements, (offset + count) // row_elements


