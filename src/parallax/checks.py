"""Value checks shared by every layer. Python's ``bool`` is an ``int``: ``True`` must not pass
as a count, a step or a partition number, so "an int" means "an int, not a bool" here."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TypeGuard

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["is_dtensor", "is_int", "is_number"]


def is_int(value: object, at_least: int | None = None) -> bool:
    """Whether ``value`` is an int (not a bool), and ``>= at_least`` when that is given."""
    if not isinstance(value, int) or isinstance(value, bool):
        return False
    return at_least is None or value >= at_least


def is_number(value: object) -> bool:
    """Whether ``value`` is an int or a float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_dtensor(value: object) -> TypeGuard[DTensor]:
    """Whether ``value`` is a DTensor (a parameter split by model parallelism), without
    importing ``torch.distributed.tensor`` (sympy with it: 0.7 s of the ``parallax`` command's
    start-up; a worker's first optimizer imports it anyway, through torch._dynamo): no DTensor
    exists before that module is imported."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)
