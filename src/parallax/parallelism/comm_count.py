"""Counting the bytes of DTensor's collectives, per communicator.

DTensor issues its collectives (the partial sums of a row split, the all-gathers of gathered
outputs, the reductions of input gradients) as c10d *functional* ops from inside its own
dispatch; neither c10d nor DTensor reports their sizes. torch's ``CommDebugMode`` counts the
calls but not the bytes, and tracks modules at a cost; this mode records only what the cost
model needs: bytes each rank sends, by the ring schedule gloo runs, per process group.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CollectiveCounter"]

_functional = torch.ops._c10d_functional
# op -> (index of its group-name argument, what one rank sends per byte of its input)
_ALL_REDUCE = {_functional.all_reduce, _functional.all_reduce_}
_ALL_GATHER = {_functional.all_gather_into_tensor}
_REDUCE_SCATTER = {_functional.reduce_scatter_tensor}


class CollectiveCounter(TorchDispatchMode):
    """While active, adds to ``sent[group_name]`` the bytes this rank sends in each
    functional collective (ring schedules: all-reduce ``2 (n-1)/n`` of the tensor,
    all-gather ``(n-1)`` times the local piece, reduce-scatter ``(n-1)/n`` of the input) and
    counts the calls in ``calls[group_name]``. ``sizes`` gives each group's size by name."""

    def __init__(self, sizes: dict[str, int]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # (torch's is unannotated)
        self.sizes = sizes
        self.sent: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        packet = func._overloadpacket
        if packet in _ALL_REDUCE or packet in _ALL_GATHER or packet in _REDUCE_SCATTER:
            self._record(packet, args, kwargs or {})
        return func(*args, **(kwargs or {}))

    def _record(self, packet: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        tensor = args[0]
        name = args[-1] if isinstance(args[-1], str) else kwargs.get("group_name", "")
        n = self.sizes.get(name, 0)
        if n <= 1:
            return
        size = tensor.numel() * tensor.element_size()
        if packet in _ALL_REDUCE:
            sent = 2 * (n - 1) * size / n
        elif packet in _ALL_GATHER:
            sent = (n - 1) * size
        else:
            sent = (n - 1) * size / n
        self.sent[name] += sent
        self.calls[name] += 1
