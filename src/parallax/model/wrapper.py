"""`ModuleWrapper`: a module that stands for the user's (``.module``), as DDP's wrapper does;
what it does not define itself is read from the user's module (``init_hidden``, ...)."""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["ModuleWrapper"]


class ModuleWrapper(nn.Module):
    """Base of `parallax.DistributedModel` and of ``parallax verify``'s reference model."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self._modules.get("module")
            if module is None:
                raise
            return getattr(module, name)  # the user's own methods, e.g. init_hidden
