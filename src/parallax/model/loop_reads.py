"""A table's layer called by the program itself, outside the model's forward.

A single-device program may call its embedding layer in the loop: a penalty on the rows a
batch looked up (``loss + c * model.emb(ids).pow(2).mean()``), the item vectors of a
retrieval loss. The user's layer holds a storage-less handle (`parallax.engine.tables.
handles`), so the call would fail; `serve_layer_calls` makes it call the layer's stand-in in
the module tree that runs instead, which reads the rows from the table as the model's own
lookups do (collective: every rank makes the call) and whose gradient rows join the step's
push. The program's forward hooks on the layer still run around it, as on one device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from parallax.model.detect import SparseUse
from parallax.model.stand_ins import ShardedEmbedding, ShardedEmbeddingBag

__all__ = ["LayerCall", "layers_back", "serve_layer_calls"]


class LayerCall:
    """The ``forward`` of a user's embedding layer: ``before()`` (the loop's order check,
    the batch to the device), then the stand-in's forward."""

    def __init__(self, stand_in: nn.Module,
                 before: Callable[[tuple[Any, ...], dict[str, Any]],
                                  tuple[tuple[Any, ...], dict[str, Any]]]) -> None:
        self.stand_in = stand_in
        self.before = before

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = self.before(args, kwargs)
        # its forward alone: the layer's call around it runs the hooks the two share
        return self.stand_in.forward(*args, **kwargs)


def serve_layer_calls(model: nn.Module, executed: nn.Module, sparse_uses: dict[str, SparseUse],
                      before: Callable[[tuple[Any, ...], dict[str, Any]],
                                       tuple[tuple[Any, ...], dict[str, Any]]]) -> None:
    """Point each ``nn.Embedding``/``nn.EmbeddingBag`` of ``model`` whose table has a
    stand-in in ``executed`` (found by its table's name: a retraced tree has other paths) at
    it (an instance ``forward``: ``model``'s layers are not in the tree that runs, so only the
    program's own calls reach it)."""
    stand_ins = {module.table.name: module for module in executed.modules()
                 if isinstance(module, (ShardedEmbedding, ShardedEmbeddingBag))}
    for name, use in sparse_uses.items():
        path = use.module_path
        stand_in = stand_ins.get(name)
        if use.kind == "gather" or path is None or stand_in is None:
            continue
        layer = model.get_submodule(path)
        if isinstance(layer, (nn.Embedding, nn.EmbeddingBag)):
            layer.forward = LayerCall(stand_in, before)  # type: ignore[method-assign]


def layers_back(model: nn.Module) -> None:
    """Each layer of ``model`` that `serve_layer_calls` pointed at its stand-in calls its own
    ``forward`` again (a world of one whose tables are the program's own parameters: the
    layer's read is the table's)."""
    for layer in model.modules():
        if isinstance(layer.__dict__.get("forward"), LayerCall):
            del layer.forward
