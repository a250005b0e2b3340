"""Slim-DP's choices, as pure functions: which values form the core, which ones a worker
explores, and the bytes a communication round moves (the traffic model the tests hold the
engine to).

Each server decides for its own contiguous range of the dense values, so no server needs
another's values: the core is the top ``round(β·n)`` of the range by significance, the explorer
``round(α·n)`` minus that, drawn uniformly from the rest of the range.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def core_size(n: int, beta: float) -> int:
    """Values of a range of ``n`` in its core: at least one of a non-empty range, none with
    ``beta`` 0 (the paper's ablation without a core: every round's values are the explorer's,
    DropConnect-like)."""
    return min(n, max(1, round(beta * n))) if n and beta > 0 else 0


def explorer_size(n: int, alpha: float, beta: float) -> int:
    """Values of a range of ``n`` each worker explores per round besides the core."""
    return max(0, min(n, round(alpha * n)) - core_size(n, beta))


def select_core(values: Tensor, update: Tensor | None, count: int, significance: float,
                ) -> Tensor:
    """The ``count`` indices of the largest ``|w| + c·|Δw|`` (``update`` None: ``|w|``),
    sorted."""
    score = values.abs()
    if update is not None and significance:
        score = score + significance * update.abs()
    return torch.topk(score, count, sorted=False).indices.sort().values


def complement(n: int, core: Tensor) -> Tensor:
    """The indices of a range of ``n`` outside ``core``, ascending."""
    outside = torch.ones(n, dtype=torch.bool, device=core.device)
    outside[core] = False
    return outside.nonzero().view(-1)


def explorer_generator(seed: int, rank: int, round_: int, server: int) -> torch.Generator:
    """The generator a worker draws round ``round_``'s explorer in server ``server``'s range
    from: a different draw per worker, round and server, the same on every run."""
    mixed = ((((seed % 2**61) * 1_000_003 + rank) * 1_000_003 + round_) * 1_000_003 + server)
    return torch.Generator().manual_seed(mixed % 2**63)


def draw_explorer(outside: Tensor, count: int, generator: torch.Generator) -> Tensor:
    """``count`` distinct indices drawn uniformly from ``outside`` (the core's complement)."""
    order = torch.randperm(outside.numel(), generator=generator)[:count]
    return outside[order.to(outside.device)]


@dataclass(frozen=True)
class RoundBytes:
    """Bytes one worker sends to (push) and receives from (pull) one server in a round."""

    push_values: int
    push_keys: int
    pull_values: int


def round_bytes(n: int, *, alpha: float, beta: float, full: bool, value_bytes: int,
                key_bytes: int, encoded: int | None = None) -> RoundBytes:
    """The traffic model of one round between a worker and the server of a range of ``n``:
    a full round moves every value both ways; a partial one pushes the core's values (its keys
    are cached), the explorer's keys and values, and pulls their values: with keys as wide as
    values, ``(2α-β)·n`` pushed and ``α·n`` pulled against Plump-DP's ``n`` and ``n``.
    ``encoded``: the size of the quantised pushed values, when a codec encodes them."""
    core, explored = (n, 0) if full else (core_size(n, beta), explorer_size(n, alpha, beta))
    values = core + explored
    return RoundBytes(push_values=encoded if encoded is not None else values * value_bytes,
                      push_keys=explored * key_bytes, pull_values=values * value_bytes)
