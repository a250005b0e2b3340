"""Decide which parameters are *sparse* and rewrite row gathers on them.

Parallax AllReduces dense parameters but row-partitions sparse ones on parameter servers,
because a step of an embedding-style parameter touches only a few rows: shipping the whole
gradient through AllReduce would waste almost all of the bandwidth.  Getting the split wrong
is costly in both directions: a parameter wrongly called sparse trains incorrectly (rows that
are read in some other way never see their gradient), a parameter wrongly called dense is
merely slow.  Every rule below therefore falls back to *dense* whenever it cannot prove that
each use of a parameter is a row gather.

Two sources of evidence are combined:

* the module structure: the ``weight`` of an ``nn.Embedding`` / ``nn.EmbeddingBag`` is a row
  table by construction, which works even for models that ``torch.fx`` cannot trace;
* an ``torch.fx.symbolic_trace`` of the model, which shows every other place a parameter is
  read, so tied / re-used weights can be demoted and hand-written gathers
  (``F.embedding(ids, w)``, ``w[ids]``, ``w.index_select(0, ids)``) can be promoted.

:func:`rewrite_gathers` then turns each hand-written gather into a call of a replacement module
(for instance one that fetches the rows from a parameter server), so the rest of the model can
stay a plain, shared ``nn.Module``.
"""

from __future__ import annotations

import builtins
import inspect
import logging
import operator
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from parallax.checks import is_int
from parallax.engine.tables.lookup_options import BatchDependent
from parallax.errors import InternalError, UnsupportedProgramError
from parallax.model.trace_reads import Reads, recording

__all__ = ["BatchDependent", "SparseUse", "batch_dependent_reads", "find_sparse_parameters",
           "rewrite_gathers", "trace_gathers", "tracing_once"]

logger = logging.getLogger("parallax")

# id(model) -> its trace, the error tracing raised, or None (not traced yet), for the models
# inside a `tracing_once` block
_sharing: dict[int, fx.GraphModule | Exception | None] = {}


@contextmanager
def tracing_once(model: nn.Module) -> Iterator[None]:
    """Within this block the functions here that read ``model``'s trace share one, taken
    by the first of them (a trace runs the model's Python: tens of milliseconds a model;
    `find_sparse_parameters` and `batch_dependent_reads` read the same one). The model must
    not change inside the block."""
    key = id(model)
    outer = key in _sharing
    if not outer:
        _sharing[key] = None
    try:
        yield
    finally:
        if not outer:
            del _sharing[key]


def _read_trace(model: nn.Module) -> fx.GraphModule:
    """``fx.symbolic_trace(model)``, once per `tracing_once` block (for reading only:
    `rewrite_gathers`, which edits its trace, takes its own)."""
    key = id(model)
    if key not in _sharing:
        return _symbolic_trace(model)
    known = _sharing[key]
    if known is None:
        try:
            known = _symbolic_trace(model)
        except Exception as error:  # tracing runs the user's code: raised again to each
            known = error
        _sharing[key] = known
    if isinstance(known, Exception):
        raise known
    return known


def _symbolic_trace(model: nn.Module) -> fx.GraphModule:
    """``fx.symbolic_trace(model)``, leaving the program's modules as they were: what the
    trace's run of ``forward`` wrote on them (a call counter) is undone."""
    tracer = fx.Tracer()
    with recording(model, lambda m, path: not tracer.is_leaf_module(m, path)):
        graph = tracer.trace(model)
        return fx.GraphModule(tracer.root, graph, type(model).__name__)


SparseKind = Literal["embedding", "embedding_bag", "gather"]


@dataclass(frozen=True)
class SparseUse:
    """How one sparse parameter is used, i.e. what a sparse implementation must replace.

    ``kind`` says where the row gather happens: inside an ``nn.Embedding`` (``"embedding"``) or
    ``nn.EmbeddingBag`` (``"embedding_bag"``) module at ``module_path``, or in hand-written
    forward code (``"gather"``, ``module_path`` is ``None``) that :func:`rewrite_gathers` can
    redirect.  ``sparse_grad`` records whether the single-device program would produce a sparse
    (COO) gradient, so a distributed implementation can reproduce the same optimizer semantics.
    """

    name: str
    kind: SparseKind
    module_path: str | None
    num_rows: int
    sparse_grad: bool
    batch_dependent: BatchDependent | None = None


def _batch_dependent(max_norm: Any, norm_type: Any, scale: Any) -> BatchDependent | None:
    """The options, or None when both are off."""
    if max_norm is None and not scale:
        return None
    return BatchDependent(None if max_norm is None else float(max_norm), float(norm_type),
                          bool(scale))


@dataclass(frozen=True)
class _Gather:
    """One row-gather node: the index tensor and the F.embedding options that matter."""

    ids: fx.Node
    padding_idx: int | None
    sparse: bool
    batch_dependent: BatchDependent | None = None


# --------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------


def find_sparse_parameters(model: nn.Module) -> dict[str, SparseUse]:
    """Return the parameters of ``model`` that should live on parameter servers.

    The result maps each sparse parameter's name (as in ``model.named_parameters()``, whose
    order it keeps) to its :class:`SparseUse`.  A parameter is sparse only when every read of it
    is a row gather, because only then is its gradient confined to the gathered rows:

    * ``nn.Embedding`` / ``nn.EmbeddingBag`` weights are sparse unless tied to another
      registration or, when the model can be traced, also read outside the module call (e.g.
      an output projection); ``max_norm`` and ``scale_grad_by_freq`` are recorded in
      :attr:`SparseUse.batch_dependent`, for the servers to apply over the global batch;
    * with a trace, any other parameter with at least two dimensions whose every use is
      ``F.embedding(ids, w)``, ``w[ids]`` or ``index_select(w, 0, ids)`` is sparse with kind
      ``"gather"``;
    * frozen parameters (``requires_grad=False``) are never sparse: they have no gradient.

    ``torch.fx`` only keeps modules defined in ``torch.nn`` opaque; a user subclass of
    ``nn.Embedding`` is traced through, so its weight is judged by its ``F.embedding`` call and
    reported with kind ``"gather"`` (which :func:`rewrite_gathers` then handles).

    If ``torch.fx.symbolic_trace`` fails (e.g. data-dependent Python control flow), one note
    (``INFO``: rank 0 alone prints it) is logged on the ``"parallax"`` logger and only the
    module rule is applied, so such models still get their embeddings partitioned.
    """
    try:
        gm: fx.GraphModule | None = _read_trace(model)
    except Exception as exc:  # tracing runs arbitrary user code: any error means "no trace"
        gm = None
        # a note, not a warning: the model trains as it is (INFO: rank 0 says it, once)
        logger.info(
            "parallax: torch.fx cannot trace %s (%s: %s); finding sparse parameters with the "
            "nn.Embedding/nn.EmbeddingBag module rule only",
            type(model).__name__,
            type(exc).__name__,
            _first_line(exc),
        )

    owners = _parameter_owners(model)
    module_paths = {id(m): path for path, m in model.named_modules()}
    graph_uses = _collect_graph_uses(model, gm) if gm is not None else None

    result: dict[str, SparseUse] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad or isinstance(param, nn.parameter.UninitializedParameter):
            continue
        if graph_uses is None:
            use = _module_rule(name, param, owners, module_paths)
        else:
            use = _traced_rule(name, param, owners, module_paths, graph_uses)
        if use is not None:
            result[name] = use
    return result


def batch_dependent_reads(model: nn.Module) -> dict[str, tuple[str, BatchDependent]]:
    """Every parameter of ``model`` read with ``max_norm`` or ``scale_grad_by_freq``: its name
    -> (where: the module path or ``F.embedding``, the options).

    Such a read is exact distributed only where parallax applies the options over the global
    batch (sparse tables); the runner refuses the others (a tied weight, a frozen table with
    ``max_norm``), since each worker would apply them to its own part of the batch.
    """
    names: dict[int, str] = {}  # a tied parameter by its first name, as named_parameters()
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name)
    found: dict[str, tuple[str, BatchDependent]] = {}
    for path, module in model.named_modules():
        if isinstance(module, _EMBEDDING_TYPES) and id(module.weight) in names:
            options = _batch_dependent(module.max_norm, module.norm_type,
                                       module.scale_grad_by_freq)
            if options is not None:
                found.setdefault(names[id(module.weight)], (path, options))
    try:
        gm = _read_trace(model)
    except Exception:  # find_sparse_parameters already said why; modules were scanned above
        return found
    for node in gm.graph.nodes:
        signature = _FUNCTIONAL_LOOKUPS.get(node.target) if node.op == "call_function" else None
        if signature is None:
            continue
        try:
            bound = signature.bind(*node.args, **node.kwargs)
        except TypeError:
            continue
        bound.apply_defaults()
        args = bound.arguments
        weight = args["weight"]
        value = (_resolve(model, str(weight.target))
                 if isinstance(weight, fx.Node) and weight.op == "get_attr" else None)
        if not isinstance(value, nn.Parameter) or id(value) not in names:
            continue
        where = f"F.{node.target.__name__}"
        if any(isinstance(args[k], fx.Node) for k in ("max_norm", "scale_grad_by_freq")):
            found.setdefault(names[id(value)], (where, BatchDependent()))
            continue
        options = _batch_dependent(args["max_norm"], args["norm_type"],
                                   args["scale_grad_by_freq"])
        if options is not None:
            found.setdefault(names[id(value)], (where, options))
    return found


def rewrite_gathers(
    model: nn.Module,
    uses: dict[str, SparseUse],
    make_gather: Callable[[str], nn.Module],
) -> nn.Module:
    """`trace_gathers`' module alone."""
    return trace_gathers(model, uses, make_gather)[0]


class _Tracer(fx.Tracer):
    """fx's tracer, with parallax's lookup stand-ins (``_parallax_leaf``) as leaves."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return (getattr(m, "_parallax_leaf", False)
                or super().is_leaf_module(m, module_qualified_name))


def trace_gathers(
    model: nn.Module,
    uses: dict[str, SparseUse],
    make_gather: Callable[[str], nn.Module],
) -> tuple[nn.Module, Reads]:
    """Redirect every hand-written row gather on a ``"gather"``-kind parameter to a module.

    Module-level embeddings can be swapped by replacing the module, but a gather written in
    ``forward`` (``F.embedding(ids, self.w)``, ``self.w[ids]``, ``self.w.index_select(0, ids)``)
    can only be redirected by rewriting the code.  This traces ``model`` and replaces each such
    gather with ``self._parallax_gather_<name>(ids)`` (``..., padding_idx=p)`` when
    ``F.embedding`` had a padding index, normalised to be non-negative), where the submodule is
    ``make_gather(name)``.  The replacement's ``forward(ids, padding_idx=None)`` must return
    exactly what the gather returned: rows of shape ``ids.shape + weight.shape[1:]``.

    Returns ``model`` itself if no use has kind ``"gather"``.  Otherwise returns a new
    ``fx.GraphModule`` that shares (does not copy) every other submodule, parameter and buffer
    with ``model`` and no longer references the sparse parameters, so they can be moved to
    parameter servers without the dense replicas holding them; and what the trace read of the
    modules' Python state (`parallax.model.trace_reads`: the module is what ``model``
    computes only while those values hold). A ``forward`` that writes a module's attribute is
    refused: the traced copy would not repeat the write.

    Raises ``ValueError`` if a ``"gather"`` parameter is not a parameter of ``model`` or is
    used other than as a row gather (``uses`` is stale), and re-raises the trace error if
    ``model`` cannot be traced.
    """
    gather_params: dict[str, nn.Parameter] = {}
    for name, use in uses.items():
        if use.kind != "gather":
            continue
        try:
            gather_params[name] = model.get_parameter(name)
        except AttributeError as exc:
            raise UnsupportedProgramError(
                f"{name!r} is not a parameter of {type(model).__name__}") from exc
    if not gather_params:
        return model, Reads()

    tracer = _Tracer()
    with recording(model, lambda m, path: not tracer.is_leaf_module(m, path)) as reads:
        graph = tracer.trace(model)
        gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
    if reads.program_writes:
        module, attribute = reads.program_writes[0]
        raise UnsupportedProgramError(
            f"{type(module).__name__}.forward sets self.{attribute}: parallax runs a model "
            f"with hand-written row gathers ({sorted(gather_params)}) through a traced copy "
            f"of its forward, which cannot repeat a Python side effect; move the write out "
            f"of forward, or read the table through an nn.Embedding")
    by_id = {id(p): name for name, p in gather_params.items()}
    _refuse_module_reads(model, gm.graph, by_id)
    added: dict[str, str] = {}  # submodule name -> parameter name
    for attr in list(gm.graph.nodes):
        if attr.op != "get_attr":
            continue
        value = _resolve(model, str(attr.target))
        param_name = by_id.get(id(value)) if isinstance(value, nn.Parameter) else None
        if param_name is None:
            continue
        sub_name = _gather_module(gm, param_name, make_gather, added)
        for user in list(attr.users):
            _redirect(gm.graph, user, attr, param_name, gather_params[param_name], sub_name)
        gm.graph.erase_node(attr)
        _drop_attribute(gm, model, str(attr.target))

    gm.graph.lint()
    gm.recompile()
    return gm, reads


def _refuse_module_reads(model: nn.Module, graph: fx.Graph, by_id: dict[int, str]) -> None:
    """A gather parameter read inside a called module is not only row-gathered."""
    for node in graph.nodes:
        if node.op != "call_module":
            continue
        for p in model.get_submodule(str(node.target)).parameters():
            if id(p) in by_id:
                raise UnsupportedProgramError(
                    f"parameter {by_id[id(p)]!r} is read inside module {node.target!r}, not "
                    "only by row gathers; re-run find_sparse_parameters on this model"
                )


def _gather_module(gm: fx.GraphModule, name: str, make_gather: Callable[[str], nn.Module],
                   added: dict[str, str]) -> str:
    """The submodule's name that serves ``name``'s gathers, added on first use."""
    sub_name = f"_parallax_gather_{name.replace('.', '_')}"
    if sub_name not in added:
        if hasattr(gm, sub_name):
            raise UnsupportedProgramError(
                f"cannot add submodule {sub_name!r} for {name!r}: name taken")
        gm.add_submodule(sub_name, make_gather(name))
        added[sub_name] = name
    elif added[sub_name] != name:
        raise UnsupportedProgramError(
            f"parameters {added[sub_name]!r} and {name!r} both map to {sub_name!r}"
        )
    return sub_name


def _redirect(graph: fx.Graph, user: fx.Node, attr: fx.Node, name: str, param: nn.Parameter,
              sub_name: str) -> None:
    """Replace ``user`` of the parameter ``attr``: a metadata read by its value, a row gather
    by a call of ``sub_name``; anything else is refused."""
    value = _metadata_value(user, attr, param)
    if value is not _NO_VALUE:
        def replaced(node: fx.Node) -> Any:
            return value if node is user else node

        for reader in list(user.users):
            reader.args = fx.node.map_arg(reader.args, replaced)
            reader.kwargs = fx.node.map_arg(reader.kwargs, replaced)
        graph.erase_node(user)
        return
    gather = _match_gather(user, attr, param.dim())
    if gather is None:
        raise UnsupportedProgramError(
            f"parameter {name!r} is used by {user.format_node()}, which is not a row "
            "gather; re-run find_sparse_parameters on this model"
        )
    kwargs: dict[str, Any] = {}
    if gather.padding_idx is not None:
        kwargs["padding_idx"] = _normalise_padding_idx(gather.padding_idx, param)
    with graph.inserting_before(user):
        call = graph.call_module(sub_name, (gather.ids,), kwargs)
    call.meta = dict(user.meta)
    user.replace_all_uses_with(call)
    graph.erase_node(user)


# --------------------------------------------------------------------------------------------
# classification
# --------------------------------------------------------------------------------------------

_EMBEDDING_TYPES: tuple[type[nn.Module], ...] = (nn.Embedding, nn.EmbeddingBag)


@dataclass
class _GraphUses:
    """Every place the traced graph reads each parameter, keyed by ``id(parameter)``."""

    # call_module nodes whose module (recursively) holds the parameter: opaque uses.
    module_calls: dict[int, list[nn.Module]]
    # (user node, get_attr node) pairs: explicit reads in traced code.
    attr_uses: dict[int, list[tuple[fx.Node, fx.Node]]]


def _collect_graph_uses(model: nn.Module, gm: fx.GraphModule) -> _GraphUses:
    """Index the trace by parameter so each parameter's uses can be judged together."""
    module_calls: dict[int, list[nn.Module]] = {}
    attr_uses: dict[int, list[tuple[fx.Node, fx.Node]]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            module = model.get_submodule(str(node.target))
            for p in module.parameters():
                module_calls.setdefault(id(p), []).append(module)
        elif node.op == "get_attr":
            value = _resolve(model, str(node.target))
            if isinstance(value, nn.Parameter):
                uses = attr_uses.setdefault(id(value), [])
                uses.extend((user, node) for user in node.users)
    return _GraphUses(module_calls, attr_uses)


def _traced_rule(
    name: str,
    param: nn.Parameter,
    owners: dict[int, set[tuple[nn.Module, str]]],
    module_paths: dict[int, str],
    graph_uses: _GraphUses,
) -> SparseUse | None:
    """Classify ``param`` from its uses in the trace (the module rule is a special case)."""
    called_by = graph_uses.module_calls.get(id(param), [])
    attr_uses = graph_uses.attr_uses.get(id(param), [])

    if called_by:
        # Read inside leaf modules.  Sparse only if the sole reader is the embedding module
        # that owns it as ``weight`` and nothing else in forward touches the tensor (case c).
        if attr_uses or any(m is not called_by[0] for m in called_by):
            return None
        use = _module_rule(name, param, owners, module_paths)
        if use is None or module_paths.get(id(called_by[0])) != use.module_path:
            return None
        return use

    if attr_uses:
        # Only read by traced code: sparse iff every read is a row gather.
        if param.dim() < 2:
            return None
        reads = [(user, attr) for user, attr in attr_uses
                 if _metadata_value(user, attr, param) is _NO_VALUE]
        gathers = [_match_gather(user, attr, param.dim()) for user, attr in reads]
        if not gathers or any(g is None for g in gathers):
            return None
        options = {g.batch_dependent for g in gathers if g is not None}
        if len(options) > 1:
            raise UnsupportedProgramError(
                f"parameter '{name}' is looked up with different batch-dependent options "
                f"({'; '.join(sorted(o.describe() if o else 'none' for o in options))}); "
                "parallax applies one set per table over the global batch: use the same "
                "max_norm / norm_type / scale_grad_by_freq in every F.embedding call of it")
        return SparseUse(
            name=name,
            kind="gather",
            module_path=None,
            num_rows=param.shape[0],
            sparse_grad=all(g is not None and g.sparse for g in gathers),
            batch_dependent=options.pop(),
        )

    # Not read by the traced forward at all (e.g. an embedding in an unused branch): keep the
    # module rule's answer so the weight is still placed like its siblings.
    return _module_rule(name, param, owners, module_paths)


def _module_rule(
    name: str,
    param: nn.Parameter,
    owners: dict[int, set[tuple[nn.Module, str]]],
    module_paths: dict[int, str],
) -> SparseUse | None:
    """Sparse iff ``param`` is the untied ``weight`` of a plain-gather embedding module."""
    registrations = owners.get(id(param), set())
    if len(registrations) != 1:
        return None  # tied: also registered under another module / attribute name
    ((module, attr),) = registrations
    if attr != "weight" or not isinstance(module, _EMBEDDING_TYPES):
        return None
    return SparseUse(
        name=name,
        kind="embedding" if isinstance(module, nn.Embedding) else "embedding_bag",
        module_path=module_paths[id(module)],
        num_rows=param.shape[0],
        sparse_grad=bool(module.sparse),
        batch_dependent=_batch_dependent(module.max_norm, module.norm_type,
                                         module.scale_grad_by_freq),
    )


def _parameter_owners(model: nn.Module) -> dict[int, set[tuple[nn.Module, str]]]:
    """Map ``id(parameter)`` to its distinct ``(module, attribute)`` registrations.

    A module registered under several paths (one shared module) counts once, since every call
    of it is still a call of the same embedding; a parameter assigned to two different modules
    or attribute names (tied weights) counts twice.
    """
    owners: dict[int, set[tuple[nn.Module, str]]] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        for attr, p in module._parameters.items():
            if p is not None:
                owners.setdefault(id(p), set()).add((module, attr))
    return owners


# --------------------------------------------------------------------------------------------
# recognising row gathers in a graph
# --------------------------------------------------------------------------------------------

_EMBEDDING_SIGNATURE = inspect.signature(F.embedding)
_FUNCTIONAL_LOOKUPS = {F.embedding: _EMBEDDING_SIGNATURE,
                       F.embedding_bag: inspect.signature(F.embedding_bag)}

# Ops whose result is a Python number / shape, not an index tensor: ``w[x.size(0)]`` selects one
# row by an int and must not be handed to a gather module as ``ids``.
_SCALAR_METHODS = frozenset(
    {"size", "dim", "ndimension", "numel", "nelement", "item", "tolist", "stride", "__len__"}
)
_SCALAR_ATTRS = frozenset({"shape", "ndim", "dtype", "device", "is_cuda", "layout"})
_ARITHMETIC = frozenset(
    {
        operator.add,
        operator.sub,
        operator.mul,
        operator.floordiv,
        operator.truediv,
        operator.mod,
        operator.neg,
        operator.pow,
        operator.getitem,
        builtins.min,
        builtins.max,
        builtins.abs,
        builtins.int,
    }
)
# Ops that produce bool tensors: ``w[mask]`` is boolean masking, not a row gather by ids.
_BOOL_FUNCTIONS = frozenset(
    {
        operator.lt,
        operator.le,
        operator.gt,
        operator.ge,
        operator.eq,
        operator.ne,
        operator.not_,
        torch.lt,
        torch.le,
        torch.gt,
        torch.ge,
        torch.eq,
        torch.ne,
        torch.isnan,
        torch.isinf,
        torch.isfinite,
        torch.isin,
        torch.logical_and,
        torch.logical_or,
        torch.logical_not,
        torch.logical_xor,
    }
)
_BOOL_METHODS = frozenset(
    {
        "lt",
        "le",
        "gt",
        "ge",
        "eq",
        "ne",
        "bool",
        "isnan",
        "isinf",
        "isfinite",
        "logical_and",
        "logical_or",
        "logical_not",
        "logical_xor",
        "__lt__",
        "__le__",
        "__gt__",
        "__ge__",
        "__eq__",
        "__ne__",
    }
)
_BITWISE = frozenset({operator.and_, operator.or_, operator.xor, operator.invert})


_SHAPE_METHODS = frozenset({"size", "dim", "ndimension", "numel", "nelement"})
_NO_VALUE = object()


def _metadata_value(user: fx.Node, attr: fx.Node, param: torch.Tensor) -> object:
    """What ``user`` reads if it only reads ``param``'s shape (``w.shape``, ``w.size(1)``,
    ``w.dim()``…), else ``_NO_VALUE``. Such reads are no data use: they do not make a gathered
    parameter dense, and the rewrite replaces them by the constant they return."""
    if user.kwargs or not user.args or user.args[0] is not attr:
        return _NO_VALUE
    if (user.op == "call_function" and user.target is builtins.getattr
            and len(user.args) == 2 and user.args[1] in ("shape", "ndim")):
        return tuple(param.shape) if user.args[1] == "shape" else param.dim()
    if user.op == "call_method" and user.target in _SHAPE_METHODS:
        rest = user.args[1:]
        if user.target == "size" and len(rest) == 1 and isinstance(rest[0], int):
            return param.shape[rest[0]]
        if user.target == "size" and not rest:
            return tuple(param.shape)
        if not rest:
            return param.dim() if user.target in ("dim", "ndimension") else param.numel()
    return _NO_VALUE


def _match_gather(user: fx.Node, attr: fx.Node, weight_dim: int) -> _Gather | None:
    """Return the gather ``user`` performs on parameter node ``attr``, or ``None``.

    ``None`` means "some other use" (the conservative answer), which makes the parameter dense.
    ``attr`` must appear exactly once among ``user``'s inputs, as the gathered table.
    """
    if _count_occurrences(user, attr) != 1:
        return None
    if user.op == "call_function" and user.target is F.embedding:
        return _match_embedding(user, attr)
    if user.op == "call_function" and user.target is operator.getitem:
        if len(user.args) != 2 or user.kwargs or user.args[0] is not attr:
            return None
        index = user.args[1]
        if not isinstance(index, fx.Node) or not _is_index_tensor(index):
            return None
        return _Gather(ids=index, padding_idx=None, sparse=False)
    if user.op == "call_function" and user.target is torch.index_select:
        bound = _bind_index_select(user.args, user.kwargs)
    elif user.op == "call_method" and user.target == "index_select":
        bound = _bind_index_select(user.args, user.kwargs)
    else:
        return None
    if bound is None:
        return None
    table, dim, index = bound
    if table is not attr or not isinstance(index, fx.Node) or not _is_index_tensor(index):
        return None
    if not is_int(dim) or dim not in (0, -weight_dim):
        return None
    return _Gather(ids=index, padding_idx=None, sparse=False)


def _match_embedding(user: fx.Node, attr: fx.Node) -> _Gather | None:
    """``F.embedding(ids, w, padding_idx=?, max_norm=?, norm_type=?, scale_grad_by_freq=?,
    sparse=?)`` with every option a constant."""
    try:
        bound = _EMBEDDING_SIGNATURE.bind(*user.args, **user.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    args = bound.arguments
    ids, padding_idx, sparse = args["input"], args["padding_idx"], args["sparse"]
    if args["weight"] is not attr or not isinstance(ids, fx.Node):
        return None
    options = (args["max_norm"], args["norm_type"], args["scale_grad_by_freq"])
    if any(isinstance(option, fx.Node) for option in options):
        return None  # computed in forward: not one fixed option per table
    if not isinstance(options[2], bool):
        return None
    if padding_idx is not None and (
        not is_int(padding_idx)
    ):
        return None
    if not isinstance(sparse, bool):
        return None
    return _Gather(ids=ids, padding_idx=padding_idx, sparse=sparse,
                   batch_dependent=_batch_dependent(*options))


def _bind_index_select(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, Any, Any] | None:
    """Bind ``index_select(input, dim, index)`` (function or method form); ``None`` if odd."""
    names = ("input", "dim", "index")
    if len(args) > len(names):
        return None
    bound = dict(zip(names, args, strict=False))
    for key, value in kwargs.items():
        if key not in names or key in bound:
            return None  # ``out=`` or a duplicate: not a plain gather
        bound[key] = value
    if len(bound) != len(names):
        return None
    return bound["input"], bound["dim"], bound["index"]


def _count_occurrences(user: fx.Node, target: fx.Node) -> int:
    count = 0

    def visit(node: fx.Node) -> fx.Node:
        nonlocal count
        if node is target:
            count += 1
        return node

    fx.node.map_arg((user.args, user.kwargs), visit)
    return count


def _is_index_tensor(node: fx.Node) -> bool:
    """Best-effort check that ``node`` is an integer index tensor (symbolic traces carry no dtypes).

    Rejects values derived from shapes / ``.item()`` (Python ints) and from comparisons
    (boolean masks); anything else is assumed to be an integer tensor of row ids.
    """
    return not _is_scalar(node) and not _is_bool(node)


def _is_scalar(node: fx.Node, depth: int = 0) -> bool:
    if depth > 16:
        return False
    if node.op == "call_method" and node.target in _SCALAR_METHODS:
        return True
    if node.op == "call_function":
        if node.target is builtins.getattr:
            return len(node.args) >= 2 and node.args[1] in _SCALAR_ATTRS
        if node.target is builtins.len:
            return True
        if node.target in _ARITHMETIC:
            return any(_is_scalar(a, depth + 1) for a in node.all_input_nodes)
    return False


def _is_bool(node: fx.Node, depth: int = 0) -> bool:
    if depth > 16:
        return False
    if node.op == "call_function":
        if node.target in _BOOL_FUNCTIONS:
            return True
        if node.target in _BITWISE:
            return any(_is_bool(a, depth + 1) for a in node.all_input_nodes)
    if node.op == "call_method":
        if node.target in _BOOL_METHODS:
            return True
        if node.target in ("__and__", "__or__", "__xor__", "__invert__", "logical_not"):
            return any(_is_bool(a, depth + 1) for a in node.all_input_nodes)
    return False


# --------------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------------


def _resolve(root: nn.Module, target: str) -> object | None:
    """The object at dotted path ``target`` under ``root``, or ``None`` (e.g. fx constants)."""
    obj: object = root
    for atom in target.split("."):
        try:
            obj = getattr(obj, atom)
        except AttributeError:
            return None
    return obj


def _normalise_padding_idx(padding_idx: int, weight: torch.Tensor) -> int:
    """Mirror F.embedding, which turns a negative padding_idx into ``num_rows + padding_idx``."""
    return padding_idx + weight.shape[0] if padding_idx < 0 else padding_idx


def _drop_attribute(gm: fx.GraphModule, model: nn.Module, target: str) -> None:
    """Remove the GraphModule's copy of the reference to a rewritten parameter.

    ``fx.GraphModule`` copies every ``get_attr`` target onto itself, creating fresh empty
    container modules along the path; the containers are the GraphModule's own, so deleting
    the attribute (and containers that become empty) never touches ``model``.
    """
    *prefix, field = target.split(".")
    chain: list[tuple[nn.Module, str]] = []
    owner: nn.Module = gm
    for atom in prefix:
        child = getattr(owner, atom, None)
        if not isinstance(child, nn.Module):
            return
        chain.append((owner, atom))
        owner = child
    if prefix and owner is _resolve(model, ".".join(prefix)):
        # Would mutate the user's module; cannot happen for a true gather parameter because a
        # parent called as a leaf module would have made the parameter dense.
        raise InternalError(f"cannot detach {target!r}: its owner module is shared with the model")
    if hasattr(owner, field):
        delattr(owner, field)
    for parent, atom in reversed(chain):
        child = getattr(parent, atom)
        if next(iter(child.children()), None) is not None:
            break
        if child._parameters or child._buffers:
            break
        delattr(parent, atom)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "(no message)"
