"""`ModuleWrapper`: a module that stands for the user's (``.module``), as DDP's wrapper does;
what it does not define itself is read from the user's module (``init_hidden``, ...).

Its parameters and buffers carry the single-device program's names (``embedding.weight``, not
DDP's ``module.embedding.weight``), as its ``state_dict`` does: so
``torch.distributed.checkpoint.state_dict.get_state_dict``/``set_state_dict`` (DCP's usual way
in, which strips DDP's ``module.`` knowing DDP by its class) name the optimizer's state as a
plain program's, and a checkpoint moves between the two. Its module walk (``named_children``)
still shows ``module``; the ``_fqn_modifiers`` hook tells that walk to leave it out."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import Tensor, nn

from parallax.errors import InternalError

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

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """The user's module's parameters under the single-device names."""
        return self._user_module().named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, Tensor]]:
        """The user's module's buffers under the single-device names."""
        return self._user_module().named_buffers(prefix, recurse, remove_duplicate)

    def _user_module(self) -> nn.Module:
        module = self._modules.get("module")
        if module is None:
            raise InternalError("the wrapper's parameters were read before its module was set")
        return module

    def _fqn_modifiers(self) -> dict[str, str]:
        """For ``torch.distributed.checkpoint.state_dict``: a name's first part is found
        under ``module`` and ``module`` is no part of a name (the key ``""`` names no child:
        it keeps ``module`` among the values where the user's module has no children)."""
        module = self._modules.get("module")
        children = [] if module is None else [name for name, _ in module.named_children()]
        return {"": "module", **{name: "module" for name in children}}
