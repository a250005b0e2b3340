"""AllReduce across machines rather than across ranks.

A flat ring over all ``W`` ranks sends ``2 w (W-1) / W`` out of every rank; with ``k`` workers
per machine, each machine's link then carries ``4 w (W-1) / W`` (sent + received), and the
ring crosses the machine boundary as often as ranks do. Reducing to one leader per machine
first, ring-AllReducing among the ``N`` leaders, and broadcasting back inside each machine puts
``4 w (N-1) / N`` on each machine's link: the papers' Table 3 figure for AllReduce, and with
``k = 2`` workers on 2 machines a third less than the flat ring.

`join` creates the groups once per process (every rank takes part, in the same order);
`all_reduce` falls back to a flat AllReduce over the given group when they do not exist or
when one level would be trivial (one machine, or one worker per machine).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from parallax.cluster import WorkerInfo
from parallax.engine.tables.exchange import Traffic
from parallax.errors import InternalError

__all__ = ["account", "account_bytes", "all_reduce", "join", "leave"]


@dataclass
class _Groups:
    machine: dist.ProcessGroup          # the ranks of this worker's machine
    leaders: dist.ProcessGroup | None   # one rank per machine; None on the others
    leader: int                         # global rank of this machine's leader
    num_machines: int


_groups: _Groups | None = None


def join(worker: WorkerInfo, *, backend: str, timeout: timedelta) -> None:
    """Create the machine and leader groups (collective over all ranks), unless a flat ring
    is already one hop per machine."""
    global _groups
    machines = len(worker.server_ranks)
    if _groups is not None or machines == 1 or worker.world_size == machines:
        return
    mine = None
    for machine in range(machines):  # every rank creates every group, in the same order
        ranks = [r for r, m in enumerate(worker.machine_of_rank) if m == machine]
        group = dist.new_group(ranks, backend=backend, timeout=timeout)
        if machine == worker.machine:
            mine = group
    leaders = dist.new_group(list(worker.server_ranks), backend=backend, timeout=timeout)
    leader = worker.server_ranks[worker.machine]
    if mine is None:
        raise InternalError(f"rank {worker.rank}: machine {worker.machine} has no group")
    _groups = _Groups(mine, leaders if worker.rank == leader else None, leader, machines)


def leave() -> None:
    """Destroy the groups `join` made (before the default group goes)."""
    global _groups
    if _groups is not None and dist.is_initialized():
        if _groups.leaders is not None:
            dist.destroy_process_group(_groups.leaders)
        dist.destroy_process_group(_groups.machine)
    _groups = None


def account(tensor: torch.Tensor, *, traffic: Traffic, name: str) -> None:
    """Record, under ``name``, the bytes an `all_reduce` of ``tensor`` moves (derived from the
    schedule: c10d reports none)."""
    account_bytes(tensor.numel() * tensor.element_size(), traffic=traffic, name=name)


def account_bytes(payload: int, *, traffic: Traffic, name: str) -> None:
    """`account` of a tensor of ``payload`` bytes."""
    if _groups is None:
        traffic.record_ring_allreduce(name, payload)
    else:
        traffic.record_hierarchical_allreduce(name, payload, leader=_groups.leader,
                                              num_machines=_groups.num_machines)


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """Sum ``tensor`` over all ranks in place, machine by machine when `join` made groups,
    else one flat AllReduce over ``group``."""
    if _groups is None:
        dist.all_reduce(tensor, group=group)
        return
    dist.reduce(tensor, dst=_groups.leader, group=_groups.machine)
    if _groups.leaders is not None:
        dist.all_reduce(tensor, group=_groups.leaders)
    dist.broadcast(tensor, src=_groups.leader, group=_groups.machine)
