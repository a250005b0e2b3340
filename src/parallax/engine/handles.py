"""The user's copy of a server-held parameter, released.

Once a parameter's rows live on the servers, the copy in the user's module would only be a
stale full table in every worker process: memory that sharding exists to save. It is released
in place: `torch.utils.swap_tensors` turns the very Parameter object (the one the user's
optimizer and modules hold; ids stay valid) into a tensor on the ``meta`` device, with its shape
and dtype but no storage. Reading it outside parallax fails at once with torch's "Tensor on
device meta is not on the expected device" instead of computing with stale values;
``runner.state_dict()`` / ``model.state_dict()`` bring the real values back from the servers.
A parameter that leaves the servers (the hybrid's move to AllReduce) gets its values back with
`restore`.

Why not a custom handle class: a different object would break every identity the user's
program and optimizer rely on, and a tensor subclass cannot be swapped into a Parameter's
data. The meta device is torch's own "shape without storage".
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor, nn

__all__ = ["is_released", "release", "restore"]


def release(param: nn.Parameter) -> None:
    """Drop ``param``'s storage, keeping the object, its shape, dtype and requires_grad.
    A parameter something holds a weak reference to (``nn.LSTM`` keeps its flat weights so)
    cannot be swapped and keeps its storage: only dense layers under ps/optps are such."""
    if is_released(param) or weakref.getweakrefcount(param):
        return
    handle = nn.Parameter(torch.empty_like(param, device="meta"),
                          requires_grad=param.requires_grad)
    _swap(param, handle)


def restore(param: nn.Parameter, values: Tensor) -> None:
    """Give ``param`` ``values`` (and the storage a released one had none of; same object)."""
    if not is_released(param):
        with torch.no_grad():
            param.copy_(values.reshape(param.shape))
        return
    full = nn.Parameter(values.detach().reshape(param.shape).to(param.dtype).clone(),
                        requires_grad=param.requires_grad)
    _swap(param, full)


def is_released(param: Tensor) -> bool:
    return param.device.type == "meta"


def _swap(param: nn.Parameter, other: nn.Parameter) -> None:
    """``param`` takes ``other``'s data and keeps its own Python attributes (swap_tensors
    swaps ``__dict__`` too; e.g. the partition-group tag lives there)."""
    attributes = dict(param.__dict__)
    torch.utils.swap_tensors(param, other)
    param.__dict__.update(attributes)
