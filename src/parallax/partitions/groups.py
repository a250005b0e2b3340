"""Which sparse tables get a searched partition count: those created inside `partitioner()`.

As in the papers, a model marks the variables whose partitioning parallax should tune::

    with parallax.partitioner():
        self.embedding = nn.Embedding(vocab, dim)     # partition count searched

or, for a model built elsewhere, ``parallax.partition(model.embedding)``. Tables of one
partitioner share one count; the others keep `Config.num_partitions` (default: one partition per
server). Only sparse parameters held by the servers are searched; others in a partitioner
(dense layers, tables moved to AllReduce) are simply left as they are.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook

from parallax.checks import is_int
from parallax.errors import ArgumentError, ArgumentTypeError

__all__ = ["PartitionGroup", "group_of", "partition", "partitioner"]

_TAG = "_parallax_partition_group"
_unnamed = itertools.count()


@dataclass(frozen=True)
class PartitionGroup:
    """Tables sharing one searched partition count. Groups with the same ``name`` are one
    group; ``max_partitions`` caps the search (default `Config.max_partitions`)."""

    name: str
    max_partitions: int | None = None


def _group(name: str | None, max_partitions: int | None) -> PartitionGroup:
    if name is not None and (not isinstance(name, str) or not name):
        raise ArgumentError(f"partitioner name must be a non-empty str, got {name!r}")
    if max_partitions is not None and not is_int(max_partitions, at_least=1):
        raise ArgumentError(f"max_partitions must be None or an int >= 1, got {max_partitions!r}")
    # Every worker runs the same script, so the n-th unnamed partitioner is the same everywhere.
    return PartitionGroup(name if name is not None else f"partitioner-{next(_unnamed)}",
                          max_partitions)


@contextmanager
def partitioner(name: str | None = None, *,
                max_partitions: int | None = None) -> Iterator[PartitionGroup]:
    """Parameters registered on modules inside the ``with`` block form one partition group
    (the innermost partitioner wins when they nest)."""
    group = _group(name, max_partitions)

    def tag(module: nn.Module, param_name: str, param: nn.Parameter | None) -> None:
        if param is not None:
            setattr(param, _TAG, group)

    handle = register_module_parameter_registration_hook(tag)
    try:
        yield group
    finally:
        handle.remove()


def partition(target: nn.Module | nn.Parameter | Iterable[nn.Module | nn.Parameter], *,
              name: str | None = None, max_partitions: int | None = None) -> PartitionGroup:
    """Put ``target``'s parameters (a module's, a parameter, or several of either) into one
    partition group, as if created inside ``partitioner(name)``; call it before `get_runner`."""
    group = _group(name, max_partitions)
    items = [target] if isinstance(target, (nn.Module, nn.Parameter)) else list(target)
    for item in items:
        if isinstance(item, nn.Module):
            params = list(item.parameters())
        elif isinstance(item, nn.Parameter):
            params = [item]
        else:
            raise ArgumentTypeError(f"parallax.partition takes modules and parameters, got "
                            f"{type(item).__name__}")
        for param in params:
            setattr(param, _TAG, group)
    return group


def group_of(param: nn.Parameter) -> PartitionGroup | None:
    """The partition group ``param`` belongs to, if any."""
    return getattr(param, _TAG, None)
