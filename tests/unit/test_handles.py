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


def test_a_penalty_on_a_released_parameter_is_refused_with_the_optimizers_weight_decay() -> None:
    """An L2 term in the loss reads every row's values: refused, with the optimizer's
    weight_decay (the same gradient under SGD, Adam, Adagrad) as the fix; other reads get
    the general fix alone."""
    import pytest

    from parallax.errors import UnsupportedProgramError

    param = nn.Embedding(7, 3).weight
    release(param, name="emb.weight", rank=1)
    for penalty in (lambda: param.pow(2).sum(), lambda: param.norm(), lambda: 1e-3 * param):
        with pytest.raises(UnsupportedProgramError, match="weight_decay=2\\*lam") as error:
            penalty()
        assert "rank 1: parameter 'emb.weight'" in str(error.value)
        assert "test_handles.py:" in str(error.value)
    with pytest.raises(UnsupportedProgramError) as error:
        param.t()
    assert "weight_decay" not in str(error.value) and "model.state_dict()" in str(error.value)
