"""Sums over all ranks, by the cheapest exact scheme for the payload's size.

gloo's AllReduce runs a ring of ``2 (W-1)`` send/receive rounds, each one synchronising the
ranks again; on a host whose cores the ranks share, every round costs scheduling and CPU.
On 2 machines x 2 workers at an emulated 1 Gbit/s one all_to_all summed here took about a
third of the ring's CPU and wall time for small payloads, and lost from about 100k float32 on
(``benchmarks/small_sums.py``, record small_sums-2x2-1gbit).

In the all_to_all every rank sends its whole payload to every other and adds up the ``W``
pieces itself: one collective instead of a ring, but ``(W-1) b`` bytes out of each rank
instead of ``2 (W-1) b / W``. It wins while the payload is small (there, up to about 30k
float32), so it is used where each rank sends at most `ALL_TO_ALL_MAX_SENT_BYTES`, and only
over gloo (NCCL's AllReduce has no such per-round cost). Both sides of the choice depend only
on the payload's size and the group, so every rank chooses alike.

Every rank adds the pieces in rank order, so every rank gets bitwise the same sum (replicas
must stay equal).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from parallax.engine import process_group
from parallax.engine.tables import hierarchy
from parallax.engine.tables.exchange import Traffic, all_to_all
from parallax.engine.tables.riders import rank_order_sum

__all__ = ["ALL_TO_ALL_MAX_SENT_BYTES", "account", "account_payloads", "all_reduce",
           "by_all_to_all", "small"]

#: the most bytes one rank sends in an all_to_all sum, ``(W-1)`` copies of its payload: a
#: 64 KiB payload at 4 ranks, about half the measured crossover at 1 Gbit/s (see the module)
ALL_TO_ALL_MAX_SENT_BYTES = 192 * 1024


def small(payload_bytes: float, world: int) -> bool:
    """Whether a sum of ``payload_bytes`` over ``world`` ranks is small enough to go by one
    all_to_all (the rule the plan's byte predictions follow too)."""
    return world > 1 and (world - 1) * payload_bytes <= ALL_TO_ALL_MAX_SENT_BYTES


def by_all_to_all(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> bool:
    """Whether `all_reduce` sums ``tensor`` over ``group`` by one all_to_all: it is `small`
    and on CPU over gloo."""
    gloo = tensor.device.type == "cpu" and "gloo" in str(dist.get_backend(group))
    return gloo and small(tensor.numel() * tensor.element_size(),
                          process_group.size(group))


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None, *,
               all_to_all: bool | None = None) -> None:
    """Sum ``tensor`` over the ranks of ``group`` (default: all) in place: by one all_to_all
    when ``all_to_all`` (default: `by_all_to_all`; a caller that chose once for a whole
    payload passes its choice), else machine by machine (`hierarchy.all_reduce`, over the
    whole world) or one flat AllReduce. Over one rank the tensor is its own sum, left as it
    is (a collective of one would still go through c10d, and on a GPU launch kernels)."""
    world = process_group.size(group)
    if world == 1:
        return
    if by_all_to_all(tensor, group) if all_to_all is None else all_to_all:
        _sum_by_all_to_all(tensor, group)
    elif world == dist.get_world_size():  # the machines' groups apply
        hierarchy.all_reduce(tensor, group)
    else:
        dist.all_reduce(tensor, group=group)


def _sum_by_all_to_all(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    world = process_group.size(group)
    flat = tensor.detach().reshape(1, -1)
    copies = flat.expand(world, -1).contiguous()
    received = torch.empty_like(copies)
    all_to_all(received, copies, group=group)
    tensor.copy_(rank_order_sum(received).view_as(tensor))  # the same sum on every rank


def account(tensor: torch.Tensor, *, traffic: Traffic, name: str, all_to_all: bool) -> None:
    """Record, under ``name``, the bytes `all_reduce` moves for ``tensor`` (a whole payload
    or a parameter's piece of it) under the scheme ``all_to_all`` says (derived from the
    scheme: c10d reports none)."""
    account_payloads([(name, tensor.numel() * tensor.element_size())], traffic=traffic,
                     all_to_all=all_to_all)


def account_payloads(payloads: Sequence[tuple[str, int]], *, traffic: Traffic,
                     all_to_all: bool) -> None:
    """`account` of the pieces of one payload summed together, as ``(name, bytes)`` each."""
    if all_to_all:  # (itself not counted)
        traffic.record_to_every_peer_many(payloads)
    else:
        for name, payload in payloads:
            hierarchy.account_bytes(payload, traffic=traffic, name=name)
