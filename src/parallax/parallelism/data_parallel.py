"""`DataParallel`: every process holds the whole model (the default); nothing to change.

The parallelism contract's identity: the dense parameters stay replicated and synchronised by
`Config.dense_sync` (DDP), the single-device view is the model itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from parallax.parallelism.grid import Grid

__all__ = ["DataParallel"]

# nothing of the model group to count: one reusable context, none made each step
_NOTHING_TO_COUNT = contextlib.nullcontext()


class DataParallel:
    """The ``data`` parallelism: see the module docstring."""

    replaces_ddp = False
    reduces_gradients = False

    def __init__(self, world_size: int) -> None:
        self.grid = Grid(world_size, 1)
        self.sharded: dict[str, Tensor] = {}

    def prepare(self, executed: nn.Module, model: nn.Module,
                optimizers: Sequence[torch.optim.Optimizer]) -> nn.Module:
        return executed

    def counting(self) -> contextlib.AbstractContextManager[None]:
        return _NOTHING_TO_COUNT

    def reduce_gradients(self) -> None:
        """DDP reduced them during the backward."""

    def norm_parts(self) -> dict[str, Any]:
        return {}

    def is_sharded(self, param: Tensor) -> bool:
        return False

    def bytes_per_step(self) -> dict[str, float]:
        return {}

    def reset(self) -> None:
        pass

    def plain_model_state(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        return state

    def sharded_model_state(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        return state

    def load_plain_model_state(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        return state

    def plain_optimizer_state(self, optimizer: torch.optim.Optimizer,
                              state: dict[str, Any]) -> dict[str, Any]:
        return state

    def distribute_optimizer_state(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def describe(self) -> str:
        return f"parallelism: data ({self.grid.data} replicas)"

