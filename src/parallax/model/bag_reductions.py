"""Whether the rows an ``nn.Embedding`` looks up are only ever summed or averaged over each
row of ids, as ``emb(ids).mean(1)``: then each row of ids is a bag, and the table's owner could
pool it as it pools an ``nn.EmbeddingBag``'s (`parallax.engine.tables.pooled`), sending one
vector per bag instead of a row per id.

During the warm-up the stand-in layer (`parallax.model.stand_ins.ShardedEmbedding`) hands its
output to the program as `WatchedRows`: the same tensor (same values, same autograd graph) of a
subclass whose ``__torch_function__`` sees every operation the program applies to it, counts
a sum or mean over the bag dimension as bags (`BagUse`), and marks any other use (a slice, an
elementwise op, a print) as rows read otherwise. Watched from the tensor itself because an fx
trace of the program's ``forward`` would see neither Python's use of it outside the graph nor
a branch the trace did not take. Outside the warm-up the rows are a plain tensor.

Once the table pools (the planner's choice on that count, or `Config.pooled_tables`), the
stand-in returns `PooledRows` instead: no rows are pulled; a sum or mean over the bags is the
owners' pooled vectors (with its gradient sent back after the backward, as an
``nn.EmbeddingBag``'s), and any other use is refused with the table's name (the rows do not
exist on the worker: exact or refused, never zeros). Where the forward's id look-ahead sees
the lookup (`parallax.step.forward`), the owners pool its bags' sums before the forward, in
the one exchange of its bag layers' calls, and a mean is that sum divided by the bag's length
(`parallax.engine.tables.pooled.rows_reduced`); otherwise the reduction pools them itself
(``table.pool_bags``: one more exchange).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
from torch import Tensor

from parallax.engine.tables.bag_use import BagUse
from parallax.engine.tables.pooled import rows_reduced
from parallax.engine.tables.table import Table
from parallax.errors import UnsupportedProgramError

__all__ = ["PooledRows", "WatchedRows", "bag_reduction", "pooled_rows", "watched"]

_REDUCTIONS: dict[Callable[..., Any], str] = {
    torch.sum: "sum", Tensor.sum: "sum", torch.mean: "mean", Tensor.mean: "mean"}
#: what reads only the tensor's shape, type and place (no values)
_METADATA = frozenset({
    Tensor.size, Tensor.dim, Tensor.numel, Tensor.__len__,
    *(getattr(Tensor, name).__get__ for name in (  # (properties: their getters)
        "shape", "ndim", "dtype", "device", "requires_grad", "is_cuda", "grad_fn", "layout",
        "is_sparse"))})


def bag_reduction(func: Callable[..., Any], args: tuple[Any, ...],
                  kwargs: Mapping[str, Any]) -> str | None:
    """``"sum"`` or ``"mean"`` where ``func(*args, **kwargs)`` sums or averages the looked-up
    rows ``args[0]`` (ids of shape batch x bag, rows batch x bag x width) over the bag
    dimension alone, keeping no dimension and no other dtype (what ``nn.EmbeddingBag``
    computes); None for anything else."""
    mode = _REDUCTIONS.get(func)
    if mode is None or not args or len(args) > 2 or args[0].dim() != 3:
        return None
    if set(kwargs) - {"dim"} or "dim" in kwargs and len(args) > 1:
        return None  # (keepdim, dtype, out: not a bag's pooled vector)
    dim = kwargs["dim"] if "dim" in kwargs else args[1] if len(args) > 1 else None
    if isinstance(dim, (tuple, list)) and len(dim) == 1:
        dim = dim[0]
    return mode if isinstance(dim, int) and dim in (1, -2) else None


class WatchedRows(Tensor):
    """Looked-up rows whose uses are counted in ``bag_use`` (`bag_reduction` of them as bags
    of ``ids``, anything but their metadata as rows read otherwise). Every operation returns
    plain tensors: only the lookup's own output is watched."""

    _parallax_use: BagUse
    _parallax_ids: Tensor

    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: Mapping[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        watched = _first(WatchedRows, args, kwargs)  # (in a list too: torch.cat([rows, x]))
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
            if watched is not None and func not in _METADATA:
                use = watched._parallax_use
                mode = bag_reduction(func, args, kwargs) if args[0] is watched else None
                if mode is None:
                    use.rows_read_otherwise = True
                else:
                    use.add(watched._parallax_ids, None, False)
        return result


def watched(rows: Tensor, ids: Tensor, bag_use: BagUse) -> Tensor:
    """``rows`` (looked up for ``ids``) as `WatchedRows` counted in ``bag_use``."""
    out = rows.as_subclass(WatchedRows)
    out._parallax_use = bag_use
    out._parallax_ids = ids
    return out


class PooledRows(Tensor):
    """The output of a lookup (an ``nn.Embedding``'s or a gather's) whose table's owners pool
    its bags: shaped as the rows (batch x bag x width; no memory: every element one zero), a
    sum or mean over the bags is ``table.pool_bags`` of ``ids``; its metadata reads as the
    rows'; anything else is refused (`UnsupportedProgramError`)."""

    _parallax_table: Table
    _parallax_ids: Tensor
    #: the rows' sums over each bag, pooled ahead of the forward (None: pooled when reduced)
    _parallax_summed: Tensor | None

    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: Mapping[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            if func in _METADATA:
                return func(*args, **kwargs)
            rows = args[0] if args and isinstance(args[0], PooledRows) else None
            mode = None if rows is None else bag_reduction(func, args, kwargs)
            if rows is not None and mode is not None:
                table, ids = rows._parallax_table, rows._parallax_ids
                if torch.is_grad_enabled() and table.measuring:
                    table.bag_use.add(ids, None, False)
                if rows._parallax_summed is not None:  # pooled ahead, with the other bags
                    return rows_reduced(rows._parallax_summed, mode, ids.shape[1])
                return table.pool_bags(ids, None, None, mode=mode, padding_idx=None,
                                       include_last_offset=False)
        pooled = _first(PooledRows, args, kwargs)
        name = "?" if pooled is None else pooled._parallax_table.name
        raise UnsupportedProgramError(
            f"the bags of '{name}' are pooled where the table lives (its looked-up rows "
            f"were only summed or averaged over each row of ids in the warm-up, or "
            f"Config.pooled_tables names it), so the rows exist only as those sums or means; "
            f"this forward applies {getattr(func, '__name__', func)!s} to them. Keep the "
            f"rows with Config(pooled_tables=()) (or leave '{name}' out of it), or reduce "
            f"them with .sum(1) or .mean(1) alone")


def pooled_rows(table: Table, ids: Tensor, summed: Tensor | None = None) -> Tensor:
    """`PooledRows` standing for the rows ``table`` would look up for ``ids`` (batch x bag);
    ``summed``: their sums over each bag, pooled ahead of the forward (its id look-ahead),
    which a sum or mean of them then reads instead of pooling them there."""
    # (a table held as column slices: its rows are the slices', the program's K times wider)
    width = math.prod(table.row_shape) * table.sharding.slices
    rows = torch.zeros((), dtype=table.dtype, device=ids.device).expand(
        *ids.shape, width).as_subclass(PooledRows)
    rows._parallax_table = table
    rows._parallax_ids = ids
    rows._parallax_summed = summed
    return rows


T = TypeVar("T")


def _first(cls: type[T], args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> T | None:
    """The first ``cls`` among a torch function's arguments, lists and tuples searched too."""
    todo = [*args, *kwargs.values()]
    while todo:
        value = todo.pop(0)
        if isinstance(value, cls):
            return value
        if isinstance(value, (list, tuple)):
            todo.extend(value)
    return None
