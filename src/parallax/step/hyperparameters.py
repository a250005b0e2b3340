"""Every rank's optimizers must hold the same hyperparameters when they step.

A program that sets them from what one worker alone sees (``ReduceLROnPlateau.step`` on the
worker's own loss, a learning rate computed from its own batch) gives the ranks different
learning rates: the dense replicas then drift apart and each server updates its rows with
its own rate, silently. In the own loop the hyperparameters' fingerprint rides in the loop
order's per-step check (`parallax.step.loop_order.LoopOrder.gather`, no extra collective);
under `Runner.step` it rides in the push (`SettingsRider`, `parallax.engine.tables.riders`),
in its own small all_to_all only in a step that pushed no message (no server-held table
used). A difference is named on every rank, with the optimizer, group, setting and each rank's
value, before any optimizer steps.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from parallax.errors import UnsupportedProgramError

__all__ = ["SettingsRider", "fingerprint", "name_the_difference"]


def settings(optimizers: Sequence[torch.optim.Optimizer]) -> list[list[tuple[str, Any]]]:
    """Each param group's settings (everything but its parameters), as plain values."""
    # (a plain value is itself without a call: the push carries this every step)
    return [sorted([(key, value if type(value) in _PLAIN_TYPES else _plain(value))
                    for key, value in group.items() if key != "params"])
            for optimizer in optimizers for group in optimizer.param_groups]


def fingerprint(optimizers: Sequence[torch.optim.Optimizer]) -> float:
    """One number that differs between ranks whose settings differ (as far as a 52-bit hash
    tells them apart; not Python's ``hash``, which each process salts)."""
    digest = hashlib.blake2b(repr(settings(optimizers)).encode(), digest_size=8).digest()
    return float(int.from_bytes(digest, "little") % (1 << 52))  # exact in a float64


class SettingsRider:
    """This rank's settings' fingerprint, riding in the push to every rank (a `Rider`);
    `differs` tells, on every rank alike, whether the ranks' fingerprints differ."""

    key = "(settings)"  # not a parameter name: names have no parentheses

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer], *, world: int,
                 device: torch.device) -> None:
        mine = torch.tensor([[fingerprint(optimizers)]], dtype=torch.float64)
        # a copy that does not wait for the device's queue (a blocking copy to a GPU would)
        self.waiting: torch.Tensor | None = mine.expand(world, 1).contiguous().to(
            device, non_blocking=True)
        self.everyone: torch.Tensor | None = None

    def receive(self, received: torch.Tensor) -> None:
        """Every rank's fingerprint (``[world, 1]``, in rank order)."""
        self.everyone = received.cpu()

    def differs(self) -> bool:
        """Whether the ranks' settings differ (False when nothing was received: the push
        that carries it raised before it came)."""
        return self.everyone is not None and bool((self.everyone != self.everyone[0]).any())


def name_the_difference(optimizers: Sequence[torch.optim.Optimizer], *, rank: int,
                        world: int, group: dist.ProcessGroup, step: int) -> None:
    """Raise naming the first setting whose value differs between ranks (collective: every
    rank calls it once it saw the fingerprints differ)."""
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, settings(optimizers), group=group)
    said = _first_difference(everyone)
    raise UnsupportedProgramError(
        f"rank {rank}: the workers' optimizers step with different settings in step {step} "
        f"({said}): the replicas would drift apart and each server would update its rows with "
        f"its own. Set them from what every rank sees alike: a scheduler stepped on a metric "
        f"(ReduceLROnPlateau) needs the metric averaged over the workers first "
        f"(torch.distributed.all_reduce), not each worker's own loss")


def _first_difference(everyone: list[list[list[tuple[str, Any]]]]) -> str:
    """The first param group setting whose value differs between the ranks' ``settings``."""
    if len({len(groups) for groups in everyone}) > 1:
        return "the ranks' optimizers hold different numbers of param groups"
    for index, groups in enumerate(zip(*everyone, strict=True)):
        per_rank = [dict(group) for group in groups]
        for key in sorted(set().union(*per_rank)):
            values = [group.get(key) for group in per_rank]
            if any(not _same(v, values[0]) for v in values):
                return (f"param group {index}'s {key!r} differs: "
                        + ", ".join(f"rank {r} {v!r}" for r, v in enumerate(values)))
    return "a setting differs"


_PLAIN_TYPES = frozenset({bool, int, float, str, type(None)})


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value)
    return value if isinstance(value, (bool, int, float, str, type(None))) else repr(value)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return bool(a == b)
