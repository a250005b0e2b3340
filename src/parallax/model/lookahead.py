"""Ids known before the forward: so one exchange can pull every table's rows for a step.

A step that looks tables up one by one pays a few collectives per table, and with many small
lookups the step is all latency. TorchRec avoids this by making the user hand over all ids
up front (a KeyedJaggedTensor). We read them off the model instead: `build_id_program` traces
the executed model with the lookup stand-ins as leaves and, when every lookup's ids are the
forward's inputs, or plain reshapes / selections / casts of them, returns a small program that
computes all of them from the inputs. Anything else (ids computed with parameters, random
sampling inside ``forward``, untraceable control flow) gets no program, and lookups pull one
by one as before: the look-ahead may only ever skip work, never change what is computed.
"""

from __future__ import annotations

import builtins
import logging
import operator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.fx as fx
from torch import Tensor, nn

from parallax.model.stand_ins import (
    RetracedRoot,
    ShardedEmbedding,
    ShardedEmbeddingBag,
    ShardedGather,
)
from parallax.model.trace_reads import Reads, recording, same_traced

__all__ = ["IdProgram", "LookAhead", "build_id_program", "traced_id_program"]

logger = logging.getLogger("parallax")

_STAND_INS = (ShardedEmbedding, ShardedEmbeddingBag, ShardedGather)

# Pure, deterministic functions of the inputs (re-arrangements, casts, id hashing): safe to run
# twice, once ahead and once in the forward, with the same result.
_SAFE_FUNCTIONS = {operator.getitem, builtins.getattr, operator.add, operator.sub, operator.mul,
                   operator.floordiv, operator.mod, torch.reshape, torch.flatten, torch.cat,
                   torch.stack, torch.squeeze, torch.unsqueeze, torch.t, torch.transpose,
                   torch.narrow, torch.select, torch.remainder, torch.fmod, torch.clamp}
_SAFE_METHODS = {"reshape", "view", "flatten", "long", "int", "to", "contiguous", "squeeze",
                 "unsqueeze", "t", "transpose", "narrow", "select", "size", "__getitem__",
                 "clone", "view_as", "reshape_as", "remainder", "fmod", "clamp", "add", "sub",
                 "mul", "__mod__", "__add__", "__mul__", "__floordiv__"}


class LookAhead(NamedTuple):
    """One lookup stand-in call of a forward, computed ahead: the layer's path, its ids, and
    for an ``nn.EmbeddingBag`` whose offsets and per-sample weights come from the inputs too,
    ``(offsets, per_sample_weights)`` (each may be None, as in the call), else None."""

    path: str
    ids: Tensor
    bag_args: tuple[Tensor | None, Tensor | None] | None


@dataclass
class IdProgram:
    """Computes, from a forward's inputs, every lookup stand-in call of the step (`LookAhead`)
    in the order of the forward."""

    module: fx.GraphModule
    paths: tuple[str, ...]
    #: per call, whether the program's outputs hold its bag arguments (after its ids)
    bag_args: tuple[bool, ...]

    @staticmethod
    def same(a: IdProgram | None, b: IdProgram | None) -> bool:
        """Two programs (or absences of one) that compute the same ids."""
        if a is None or b is None:
            return a is b
        return (a.paths, a.bag_args) == (b.paths, b.bag_args) and same_traced(a.module,
                                                                             b.module)

    def __call__(self, *args: Any, **kwargs: Any) -> list[LookAhead]:
        with torch.no_grad():
            outputs = iter(self.module(*args, **kwargs))
        calls = []
        for path, known in zip(self.paths, self.bag_args, strict=True):
            ids = next(outputs)
            extra = (next(outputs), next(outputs)) if known else None
            calls.append(LookAhead(path, ids, extra))
        return calls


class _StandInsAsLeaves(fx.Tracer):
    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        return isinstance(module, _STAND_INS) or super().is_leaf_module(module, qualified_name)


def build_id_program(model: nn.Module) -> IdProgram | None:
    """The ids program of ``model`` (the executed model, with lookup stand-ins), or None when
    some lookup's ids cannot be computed from the inputs alone."""
    return traced_id_program(model)[0]


def traced_id_program(model: nn.Module) -> tuple[IdProgram | None, Reads]:
    """`build_id_program`, and what its trace read of the modules' Python state: the program
    (or its absence) holds only while those values do (`parallax.model.trace_reads`; a
    ``forward`` that picks its ids under ``if self.training:`` has one program per mode)."""
    # A model whose hand-written gathers fx rewrote runs its rewritten trace: traced here in
    # its stead (the root's forward takes *args, which fx cannot trace), its lookups named by
    # their path under the root
    traced, prefix = ((model.select(), "traced.") if isinstance(model, RetracedRoot)
                      else (model, ""))
    tracer = _StandInsAsLeaves()
    with recording(traced, lambda m, path: not tracer.is_leaf_module(m, path)) as reads:
        try:
            graph = tracer.trace(traced)
        except Exception as error:  # data-dependent control flow and the like
            logger.debug("parallax: no id look-ahead, tracing failed: %s", error)
            return None, reads
        return _program(traced, graph, prefix), reads


def _program(model: nn.Module, graph: fx.Graph, prefix: str = "") -> IdProgram | None:
    """The ids program of ``model``'s traced ``graph`` (its lookups' paths after ``prefix``);
    None where some lookup's ids are computed otherwise than from the inputs."""
    calls = [node for node in graph.nodes if node.op == "call_module"
             and isinstance(model.get_submodule(node.target), _STAND_INS)]
    if not calls:
        return None
    outputs: list[Any] = []
    known = []
    for call in calls:
        ids = call.args[0] if call.args else call.kwargs.get("ids")
        if not isinstance(ids, fx.Node) or not _from_inputs_only(ids):
            logger.debug("parallax: no id look-ahead: ids of %s are computed", call.target)
            return None
        outputs.append(ids)
        bag = _bag_args(call) if isinstance(model.get_submodule(call.target),
                                            ShardedEmbeddingBag) else None
        known.append(bag is not None)
        outputs.extend(bag or ())
    program = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    needed = _ancestors([node for node in outputs if isinstance(node, fx.Node)])
    for node in graph.nodes:  # every placeholder, so the program takes the forward's inputs
        if node.op == "placeholder" or node in needed:
            env[node] = program.node_copy(node, lambda n: env[n])
    program.output(tuple(env[node] if isinstance(node, fx.Node) else node
                         for node in outputs))
    return IdProgram(fx.GraphModule(model, program),
                     tuple(prefix + str(c.target) for c in calls), tuple(known))


def _bag_args(call: fx.Node) -> tuple[Any, Any] | None:
    """An ``nn.EmbeddingBag`` call's ``(offsets, per_sample_weights)`` nodes (or None
    constants), when both come from the inputs alone; else None."""
    names = ("ids", "offsets", "per_sample_weights")
    given = dict(zip(names, call.args, strict=False)) | dict(call.kwargs)
    args = (given.get("offsets"), given.get("per_sample_weights"))
    for arg in args:
        if arg is not None and not (isinstance(arg, fx.Node) and _from_inputs_only(arg)):
            return None
    return args


def _from_inputs_only(node: fx.Node) -> bool:
    for ancestor in _ancestors([node]):
        if ancestor.op == "placeholder":
            continue
        if ancestor.op == "call_function" and ancestor.target in _SAFE_FUNCTIONS:
            continue
        if ancestor.op == "call_method" and ancestor.target in _SAFE_METHODS:
            continue
        return False
    return True


def _ancestors(nodes: list[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    todo = list(nodes)
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        todo.extend(node.all_input_nodes)
    return seen

