"""One hop of the sparse exchange, and the bytes it moves.

A `Hop` is one ``all_to_all_single`` over the whole world with split sizes fixed when it is
opened; it can carry several payloads the same way (ids, then rows) and carry payloads back the
opposite way (rows to the requesters, gradients to the owners). Ranks with nothing to send or
receive take part with zero counts, so every rank issues the same collectives in the same order.

Opening a hop exchanges the counts first, in their own small all_to_all, because gloo does not
check that both sides' splits agree; that message also carries an error flag so that a bad id on
one rank fails every rank at once instead of leaving the others waiting.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

COUNT_MESSAGE_BYTES = 3 * 8  # count, error flag, bad id: int64 each


class SparseIdError(IndexError):
    """A batch holds an id outside the rows of a sparse parameter."""


def unique_ids(ids: Tensor, num_rows: int, name: str, rank: int,
               ) -> tuple[Tensor, Tensor, int | None]:
    """``(unique, inverse, bad_id)`` of a lookup's ids: sorted unique ids, the index of each
    id among them, and an id outside ``[0, num_rows)`` (or None) for `Hop.open` to report to
    every rank. Ids must be integers: float ids would be truncated silently."""
    if ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"parameter '{name}' on rank {rank}: ids must be an integer tensor, "
                        f"got {ids.dtype}")
    unique, inverse = torch.unique(ids.reshape(-1).long(), return_inverse=True)
    bad_id = None
    if unique.numel() and unique[0] < 0:
        bad_id = int(unique[0])
    elif unique.numel() and unique[-1] >= num_rows:
        bad_id = int(unique[-1])
    return unique, inverse.view(ids.shape), bad_id


@dataclass
class Traffic:
    """Bytes this rank sent and received, per parameter, within and across machines.

    Self-traffic (a worker talking to its own server) crosses nothing and is not counted.
    """

    rank: int
    machine_of_rank: tuple[int, ...]
    steps: int = 0
    bytes: dict[str, dict[str, int]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(int)))

    def record(self, name: str, send_counts: list[int], recv_counts: list[int],
               bytes_per_item: int) -> None:
        mine = self.machine_of_rank[self.rank]
        for peer, (sent, received) in enumerate(zip(send_counts, recv_counts, strict=True)):
            if peer == self.rank:
                continue
            where = "intra" if self.machine_of_rank[peer] == mine else "inter"
            self.bytes[name][f"{where}_sent"] += sent * bytes_per_item
            self.bytes[name][f"{where}_received"] += received * bytes_per_item

    def record_ring_allreduce(self, name: str, payload_bytes: int) -> None:
        """An AllReduce of ``payload_bytes`` done by gloo's ring: reduce-scatter then
        all-gather, each rank sending ``2 (W-1)/W`` of the payload to its successor and
        receiving as much from its predecessor. Derived from the schedule, not read off a
        socket: DDP and c10d do not report their bytes."""
        world = len(self.machine_of_rank)
        if world == 1:
            return
        volume = 2 * (world - 1) * payload_bytes // world
        sent, received = [0] * world, [0] * world
        sent[(self.rank + 1) % world] = volume
        received[(self.rank - 1) % world] = volume
        self.record(name, sent, received, 1)

    def per_step(self) -> dict[str, dict[str, float]]:
        steps = max(self.steps, 1)
        return {name: {k: v / steps for k, v in sorted(counts.items())}
                for name, counts in sorted(self.bytes.items())}

    def reset(self) -> None:
        self.steps = 0
        self.bytes.clear()


@dataclass
class Hop:
    """An all_to_all with fixed splits; `forward` sends along them, `backward` against them."""

    send_counts: list[int]
    recv_counts: list[int]
    group: dist.ProcessGroup
    traffic: Traffic
    name: str

    @classmethod
    def open(cls, send_counts: list[int], *, group: dist.ProcessGroup, traffic: Traffic,
             name: str, num_rows: int, bad_id: int | None = None,
             device: torch.device | None = None) -> Hop:
        """Exchange the counts (and any bad id, raising `SparseIdError` on every rank)."""
        world = len(send_counts)
        message = torch.zeros(world, 3, dtype=torch.long, device=device)
        message[:, 0] = torch.tensor(send_counts, dtype=torch.long)
        if bad_id is not None:
            message[:, 1] = 1
            message[:, 2] = bad_id
        received = torch.empty_like(message)
        dist.all_to_all_single(received, message, group=group)
        traffic.record(name, [1] * world, [1] * world, COUNT_MESSAGE_BYTES)
        failed = received[:, 1].nonzero().flatten().tolist()
        if failed:
            rank = failed[0]
            machine = traffic.machine_of_rank[rank]
            raise SparseIdError(
                f"parallax: sparse parameter '{name}' got id {int(received[rank, 2])} on rank "
                f"{rank} (machine {machine}), outside its rows [0, {num_rows})")
        return cls(send_counts, received[:, 0].tolist(), group, traffic, name)

    def forward(self, payload: Tensor) -> Tensor:
        return self._send(payload, self.send_counts, self.recv_counts)

    def backward(self, payload: Tensor) -> Tensor:
        return self._send(payload, self.recv_counts, self.send_counts)

    def _send(self, payload: Tensor, send: list[int], receive: list[int]) -> Tensor:
        out = payload.new_empty((sum(receive), *payload.shape[1:]))
        dist.all_to_all_single(out, payload.contiguous(), receive, send, group=self.group)
        item_bytes = payload.element_size() * math.prod(payload.shape[1:])
        self.traffic.record(self.name, send, receive, item_bytes)
        return out
