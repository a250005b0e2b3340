"""`parallax.engine.tables.handles`: a server-held parameter's user copy released in place."""

from __future__ import annotations

import weakref

import torch
from torch import nn

from parallax.engine.tables.handles import is_released, release, restore


def test_release_keeps_the_object_and_its_attributes_but_no_storage() -> None:
    """Same object (the optimizer still holds it), shape, dtype, requires_grad and Python
    attributes (e.g. a partition-group tag); restore brings values back into it."""
    embedding = nn.Embedding(7, 3).double()
    param = embedding.weight
    optimizer = torch.optim.SGD([param], lr=0.1)
    param.tag = "group"
    before = param.detach().clone()
    release(param)
    assert embedding.weight is param and optimizer.param_groups[0]["params"][0] is param
    assert is_released(param) and param.shape == (7, 3) and param.dtype == torch.float64
    assert param.requires_grad and param.tag == "group"
    restore(param, before)
    assert not is_released(param) and param.tag == "group"
    assert torch.equal(param.detach(), before)


def test_a_weakly_referenced_parameter_keeps_its_storage() -> None:
    """nn.LSTM keeps weak references to its flat weights: such a tensor cannot be swapped, so
    it is left as it is (and restore copies into it)."""
    lstm = nn.LSTM(2, 3)
    param = lstm.weight_ih_l0
    assert weakref.getweakrefcount(param)
    release(param)
    assert not is_released(param)
    restore(param, torch.zeros_like(param))
    assert torch.equal(param.detach(), torch.zeros_like(param))
