"""Stand-ins for the layers that read a sparse parameter: they read rows from its table.

Each holds a table (`parallax.engine.tables.table.Table`; a plain attribute, not a parameter or
buffer: DDP must never see it) and computes exactly what the original layer computes, on the
looked-up unique rows. `executed_copy` builds the module tree a run executes: the user's,
sharing every tensor, with the stand-ins in place of the sparse reads.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from parallax.engine.tables import pooled
from parallax.engine.tables.table import Table
from parallax.errors import ArgumentTypeError, InternalError, UnsupportedProgramError
from parallax.model.bag_reductions import pooled_rows, watched
from parallax.model.detect import SparseUse, trace_gathers
from parallax.model.trace_reads import Reads, TraceCache, same_traced


def executed_copy(model: nn.Module, sparse_uses: dict[str, SparseUse],
                  table_of: Callable[[str], Table], *, share_modules: bool = True) -> nn.Module:
    """A copy of ``model``'s module tree sharing every parameter and buffer, whose sparse
    reads go to ``table_of(parameter name)`` (the user's module tree is left as it is).

    With ``share_modules`` only the embedding layers' ancestors are copied (their children
    differ); every other module *is* the user's, so hooks, attributes and flags the program
    sets on it later act on what runs (`mirror` keeps the copied ancestors in step). Without
    it (model parallelism rewrites the executed layers in place) the whole tree is copied."""
    memo: dict[int, Any] = {id(t): t for t in (*model.parameters(), *model.buffers())}
    if share_modules:
        copied = {prefix for use in sparse_uses.values() if use.module_path is not None
                  for prefix in _ancestors(use.module_path)}
        memo.update({id(m): m for path, m in model.named_modules() if path not in copied})
    try:
        executed = copy.deepcopy(model, memo)
    except Exception as error:
        raise ArgumentTypeError(
            f"parallax runs a copy of the module tree of {type(model).__name__} (sharing "
            f"its parameters and buffers), but copying it failed: {error}. Keep "
            f"uncopyable objects (files, locks, sockets) out of the model's attributes."
        ) from error
    for name, use in sparse_uses.items():
        if use.kind == "gather":
            continue
        path = use.module_path
        original = model.get_submodule(path) if path is not None else None
        if isinstance(original, nn.Embedding):
            stand_in: nn.Module = ShardedEmbedding(table_of(name), original.padding_idx)
        elif isinstance(original, nn.EmbeddingBag):
            stand_in = ShardedEmbeddingBag(table_of(name), mode=original.mode,
                                           padding_idx=original.padding_idx,
                                           include_last_offset=original.include_last_offset)
        else:
            raise InternalError(f"'{name}' ({use.kind}) is read by {type(original).__name__} "
                                f"at {path!r}, not by an embedding layer")
        _share_forward_hooks(original, stand_in)
        parent_path, _, child = str(path).rpartition(".")
        executed.get_submodule(parent_path).register_module(child, stand_in)
    if not any(use.kind == "gather" for use in sparse_uses.values()):
        return executed

    def trace(source: nn.Module) -> tuple[nn.Module, Reads]:
        return trace_gathers(source, sparse_uses, lambda name: ShardedGather(table_of(name)))
    if not share_modules:  # (model parallelism rewrites the traced module's layers in place)
        return trace(executed)[0]
    return RetracedRoot(executed, trace)


class RetracedRoot(nn.Module):
    """The root that runs a model whose hand-written gathers fx rewrote
    (`parallax.model.detect.trace_gathers`): the rewritten trace of ``source`` (the executed
    copy, which `mirror` keeps in step with the user's module tree) whose Python reads still
    hold, traced again when none does (`parallax.model.trace_reads`: a trace taken in training
    mode computes its training branches, whatever the mode later)."""

    source: nn.Module

    def __init__(self, source: nn.Module,
                 trace: Callable[[nn.Module], tuple[nn.Module, Reads]]) -> None:
        super().__init__()
        object.__setattr__(self, "source", source)  # (not a child: its tensors are the traces')
        self._traces = TraceCache(lambda: trace(source),
                                  what=f"{type(source).__name__}.forward (hand-written gathers)",
                                  same=same_traced)
        first, reads = trace(source)
        self._traces.seed(first, reads)
        self.traced = first

    def forget_other_traces(self) -> None:
        """Keep only the trace in use (another is traced afresh when needed): a table was
        replaced, and the gather stand-ins of the traces kept still read the old one."""
        current = self._modules["traced"]
        self._traces.entries = [(r, t) for r, t in self._traces.entries if t is current]

    def select(self) -> nn.Module:
        """The trace for the modules' state now (its parameters are every trace's; only the
        code differs). Named as the program's module is: what to call with parameters
        swapped in by name (``torch.func.functional_call``)."""
        traced = self._traces.get()
        if self._modules["traced"] is not traced:
            self._modules["traced"] = traced
        return traced

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.select()(*args, **kwargs)


#: an ``nn.Module``'s forward hooks (torch's own attributes: ``register_forward_hook`` and
#: ``register_forward_pre_hook`` add to these dicts, a handle's ``remove`` takes from them)
_FORWARD_HOOKS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                  "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def _share_forward_hooks(layer: nn.Module, stand_in: nn.Module) -> None:
    """``stand_in`` runs ``layer``'s forward hooks and pre-hooks, those registered before
    `parallax.distribute` and after alike: it holds the layer's own hook dicts (a hook that
    changes the output changes the stand-in's, as on one device). A hook is called with the
    stand-in as its module."""
    for attribute in _FORWARD_HOOKS:
        setattr(stand_in, attribute, getattr(layer, attribute))


def _ancestors(path: str) -> list[str]:
    """The paths of the modules above ``path`` ("" is the root)."""
    parts = path.split(".")
    return [".".join(parts[:i]) for i in range(len(parts))]


_OWN = frozenset({"_modules", "_parameters", "_buffers"})  # the copy's own (same tensors)


class Mirror:
    """Keeps each copied module of the executed tree in step with the user's: called before a
    forward, every attribute but its children and tensors (hooks, flags, plain values set
    after `parallax.distribute`) goes to the copy; `back` after it, what the forward set on a
    copy (a call counter, a cached value) goes to the user's module, as if it had run."""

    def __init__(self, pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> None:
        self.pairs = pairs
        self._before: list[dict[str, Any]] = []

    def __call__(self) -> None:
        for source, target in self.pairs:
            for key, value in source.items():
                if key not in _OWN and target.get(key) is not value:
                    target[key] = value
        self._before = [dict(target) for _, target in self.pairs]

    def back(self) -> None:
        for (source, target), before in zip(self.pairs, self._before, strict=False):
            for key, value in target.items():
                if key not in _OWN and before.get(key, _ABSENT) is not value:
                    source[key] = value


_ABSENT = object()


def mirror(model: nn.Module, executed: nn.Module, *, shared_modules: bool = True) -> Mirror:
    """The `Mirror` of each copied module of ``executed`` (`executed_copy` with
    ``shared_modules``) and the user's module at its path (a root that fx rewrote for
    hand-written gathers: its source, whose modules its traces run). Without
    ``shared_modules`` (model parallelism: the executed layers carry their own parameters and
    hooks) nothing is brought over."""
    pairs: list[tuple[dict[str, Any], dict[str, Any]]] = []
    if not shared_modules:
        return Mirror([])
    if isinstance(executed, RetracedRoot):  # its traces run the source's modules
        executed = executed.source
    for path, mine in model.named_modules():
        try:
            theirs = executed.get_submodule(path)
        except AttributeError:
            continue
        if theirs is not mine and type(theirs) is type(mine):
            pairs.append((mine.__dict__, theirs.__dict__))
    return Mirror(pairs)


def _padding_row(table: Table, ids: Tensor, inverse: Tensor,
                 padding_idx: int | None) -> tuple[Tensor, int | None]:
    """``inverse`` and the original ``padding_idx`` as an index into the pulled rows (None if
    absent), so the padding row keeps a zero gradient exactly as in the original layer. Where
    the pulled rows repeat ids (`Config.id_dedup` ``"servers"``), every padding id of the
    lookup is pointed at its first one's row, which the layer's ``padding_idx`` then covers."""
    if padding_idx is None:
        return inverse, None
    if padding_idx < 0:
        padding_idx += table.num_rows
    if inverse is ids:  # the table's rows are the whole weight (`OwnTable`)
        return inverse, padding_idx
    padded = ids == padding_idx
    hits = padded.reshape(-1).nonzero()
    if not hits.numel():
        return inverse, None
    row = int(inverse.reshape(-1)[hits[0, 0]])
    held = table.held
    if held is not None and not held.id_requests.distinct:
        inverse = inverse.masked_fill(padded, row)
    return inverse, row


class TableLookup(nn.Module):
    """A stand-in layer: its rows come from ``table`` (`parallax.engine.tables.table.Table`)."""

    table: Table
    #: traced as one call (`parallax.model.detect.trace_gathers`, the id look-ahead)
    _parallax_leaf = True


def table_read_by(module: nn.Module) -> Table:
    """The table a stand-in layer reads (what the id program names by the layer's path)."""
    if not isinstance(module, TableLookup):
        raise InternalError(f"{type(module).__name__} is not a stand-in layer of a table")
    return module.table


class ShardedEmbedding(TableLookup):
    """Replaces ``nn.Embedding``: same output, rows come from the parameter servers."""

    def __init__(self, table: Table, padding_idx: int | None = None):
        super().__init__()
        self.table = table
        self.padding_idx = padding_idx

    def forward(self, ids: Tensor) -> Tensor:
        return _rows_for_bags(self.table, ids, self.padding_idx)

    def extra_repr(self) -> str:
        return f"'{self.table.name}', rows={self.table.num_rows}, padding_idx={self.padding_idx}"


class ShardedEmbeddingBag(TableLookup):
    """Replaces ``nn.EmbeddingBag`` (sum / mean / max bags, offsets, per-sample weights)."""

    def __init__(self, table: Table, *, mode: str, padding_idx: int | None,
                 include_last_offset: bool):
        super().__init__()
        self.table = table
        self.mode = mode
        self.padding_idx = padding_idx
        self.include_last_offset = include_last_offset

    def forward(self, ids: Tensor, offsets: Tensor | None = None,
                per_sample_weights: Tensor | None = None) -> Tensor:
        if torch.is_grad_enabled() and self.table.measuring:
            self.table.bag_use.add(ids, offsets, self.include_last_offset, per_sample_weights)
        if self.table.sharding.pools:  # pooled where the table lives (Config.pooled_tables)
            return self.table.pool_bags(ids, offsets, per_sample_weights, mode=self.mode,
                                   padding_idx=self.padding_idx,
                                   include_last_offset=self.include_last_offset)
        rows, inverse = self.table.lookup(ids)
        inverse, padding = _padding_row(self.table, ids, inverse, self.padding_idx)
        try:
            return F.embedding_bag(inverse, rows, offsets, mode=self.mode,
                                   per_sample_weights=per_sample_weights,
                                   include_last_offset=self.include_last_offset,
                                   padding_idx=padding)
        except IndexError as error:
            _name_bad_id(self.table, ids, error)
            raise

    def extra_repr(self) -> str:
        return f"'{self.table.name}', rows={self.table.num_rows}, mode={self.mode}"


class ShardedGather(TableLookup):
    """Replaces a row gather on a plain parameter found by tracing (``F.embedding(ids, w)``,
    ``w[ids]``, ``w.index_select(0, ids)``): returns the gathered rows."""

    def __init__(self, table: Table):
        super().__init__()
        self.table = table

    def forward(self, ids: Tensor, padding_idx: int | None = None) -> Tensor:
        return _rows_for_bags(self.table, ids, padding_idx)


def _name_bad_id(table: Table, ids: Tensor, error: IndexError) -> None:
    """Raise the id outside a table whose rows are the whole weight (`OwnTable`: the layer's
    own read failed on it) as the servers name it; return for any other index error (the
    caller re-raises it as it came)."""
    named = getattr(table, "named_bad_id", None)
    found = named(ids) if named is not None else None
    if found is not None:
        raise found from error


def bag_shaped(ids: Tensor, padding_idx: int | None) -> bool:
    """Whether a lookup of ``ids`` with ``padding_idx`` reads rows whose sums or means over
    each row of ids an owner may pool as it pools an ``nn.EmbeddingBag``'s: ids of batch x
    bag, no padding id (the padding row counts in an ``nn.Embedding``'s mean, not in a
    bag's). The one rule the lookups here and the forward's look-ahead share."""
    return ids.dim() == 2 and padding_idx is None


def _rows_for_bags(table: Table, ids: Tensor, padding_idx: int | None) -> Tensor:
    """The rows of ``ids`` (an ``nn.Embedding`` or a gather), pulled; watched in the warm-up
    for sums and means over bags, and, once the table's owners pool those, a stand-in whose
    sum or mean is theirs (`parallax.model.bag_reductions`)."""
    if table.sharding.pools:
        if not bag_shaped(ids, padding_idx):
            raise UnsupportedProgramError(
                f"the bags of '{table.name}' are pooled where the table lives "
                f"(Config.pooled_tables), but its rows are looked up with ids of shape "
                f"{tuple(ids.shape)}" + (f" and padding_idx={padding_idx}"
                                         if padding_idx is not None else "")
                + ": an owner pools rows of ids (batch x bag) without a padding id "
                "(the padding row counts in a mean here, not in an nn.EmbeddingBag's); "
                "leave it out of Config.pooled_tables")
        # (pooled ahead with the forward's other bags when the id look-ahead saw this lookup)
        held = table.held
        ahead = (pooled.serve_ahead(pooled.rows_ahead_call(held, ids))
                 if held is not None and held.steps.current.pooled_ahead.get(held.name)
                 else None)
        return pooled_rows(table, ids, ahead)
    rows, inverse = table.lookup(ids)
    inverse, padding = _padding_row(table, ids, inverse, padding_idx)
    try:
        out = F.embedding(inverse, rows, padding_idx=padding)
    except IndexError as error:
        _name_bad_id(table, ids, error)
        raise
    if not (torch.is_grad_enabled() and table.measuring):
        return out
    if not bag_shaped(ids, padding_idx):  # (no bags an owner pools alike)
        table.bag_use.rows_read_otherwise = True
        return out
    return watched(out, ids, table.bag_use)  # are they only pooled over bags?
