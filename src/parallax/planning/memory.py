"""What one process holds for training: the memory model behind the benchmarks' predicted column.

Per rank: every parameter it keeps whole (dense ones, replicated tables, and under ps/optps
the dense parameters it pulls whole each step) and its own shard of each server-held table,
each trainable one with its gradient (twice for parameters DDP synchronises: DDP keeps the
gradient and its bucket) and the per-element optimizer state its optimizer keeps, plus the
buffers. A sparse-gradient table's shard gradient holds only the touched rows and is not
counted. The optimizer state is the number of parameter-shaped tensors the optimizer's class
keeps (`state_tensors_per_parameter`: Adam 2, Adagrad 1, SGD with momentum 1, plain SGD 0),
found by one step of a fresh optimizer of the same class and arguments on a small tensor.
What torch itself takes (libraries, threads, allocator caches) is not modelled: the benchmarks
add the resident memory measured before the model is built.
"""

from __future__ import annotations

import math
import os
import resource
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from parallax.checks import is_dtensor
from parallax.engine.optimizers.shard_optimizer import (
    _constructor_arguments,
    _hyper_parameters,
    is_per_row,
    optimizer_class,
    optimizer_of,
)
from parallax.engine.tables.table import Table

__all__ = ["MemoryEstimate", "free_bytes", "predict_memory", "state_tensors_per_parameter"]


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds for training, by kind."""

    parameters: int = 0
    gradients: int = 0
    optimizer_state: int = 0
    buffers: int = 0

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state + self.buffers

    def __add__(self, other: MemoryEstimate) -> MemoryEstimate:
        return MemoryEstimate(self.parameters + other.parameters,
                              self.gradients + other.gradients,
                              self.optimizer_state + other.optimizer_state,
                              self.buffers + other.buffers)


def free_bytes(processes_per_machine: int) -> float:
    """What this process may still allocate: its share of the machine's available memory
    (``MemAvailable`` over the machine's processes) and what its ``RLIMIT_DATA`` leaves above
    its resident memory, whichever is less (inf where neither can be read)."""
    free = math.inf
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024 / max(processes_per_machine, 1)
    except OSError:
        pass
    limit = resource.getrlimit(resource.RLIMIT_DATA)[0]
    if limit != resource.RLIM_INFINITY:
        try:
            with open("/proc/self/statm") as statm:
                resident = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            free = min(free, max(limit - resident, 0))
        except (OSError, ValueError):
            pass
    return free


def state_tensors_per_parameter(optimizer: torch.optim.Optimizer) -> int:
    """How many tensors shaped like a parameter ``optimizer``'s class keeps for it after a
    step, with ``optimizer``'s arguments (0 when one step on a small tensor cannot tell)."""
    arguments = {**_hyper_parameters(optimizer.param_groups[0]),
                 **_constructor_arguments(optimizer)}
    for sparse in (False, True):  # SparseAdam takes sparse gradients only
        param = nn.Parameter(torch.zeros(2, 3, dtype=torch.float64))
        param.grad = torch.ones_like(param).to_sparse() if sparse else torch.ones_like(param)
        try:
            probe = optimizer_class(optimizer)([param], **arguments)
            probe.step()
        except Exception:  # noqa: BLE001 - e.g. dense gradients refused: try the other kind
            continue
        return sum(1 for value in probe.state[param].values() if is_per_row(value, param))
    return 0


def _held(tensors: Iterable[tuple[Tensor, Tensor]],
          optimizers: Sequence[torch.optim.Optimizer], per_optimizer: dict[int, int], *,
          gradient_copies: int) -> MemoryEstimate:
    """``(tensor, parameter)`` pairs: the memory of ``tensor``, trained as ``parameter`` (by
    its optimizer, if it requires a gradient)."""
    estimate = MemoryEstimate()
    for tensor, param in tensors:
        size = tensor.numel() * tensor.element_size()
        if not param.requires_grad:
            estimate += MemoryEstimate(parameters=size)
            continue
        owner = optimizer_of(optimizers, param)
        if owner is not None and id(owner) not in per_optimizer:
            per_optimizer[id(owner)] = state_tensors_per_parameter(owner)
        state = per_optimizer.get(id(owner), 0) if owner is not None else 0
        estimate += MemoryEstimate(parameters=size, gradients=gradient_copies * size,
                                   optimizer_state=state * size)
    return estimate


def predict_memory(module: nn.Module, tables: dict[str, Table], user_params: Mapping[str, Tensor],
                   optimizers: Sequence[torch.optim.Optimizer], *, uses_ddp: bool,
                   pulled_whole: Iterable[str] = ()) -> MemoryEstimate:
    """This rank's `MemoryEstimate`: ``module``'s parameters that hold values (the executed
    copy: its dense parameters), the tables' replicas or this rank's shards, the parameters
    ``pulled_whole`` each step, and ``module``'s buffers."""
    per_optimizer: dict[int, int] = {}
    # a parameter split by model parallelism (a DTensor) holds its local shard here
    held = [(p.to_local() if is_dtensor(p) else p, p) for p in module.parameters()
            if p.device.type != "meta"]
    estimate = _held(held, optimizers, per_optimizer, gradient_copies=2 if uses_ddp else 1)
    for name, table in tables.items():
        param = user_params[name]
        if table.replica is not None:
            estimate += _held([(table.replica, param)], optimizers, per_optimizer,
                              gradient_copies=1)
        elif table.shard is not None:
            part = _held([(table.shard, param)], optimizers, per_optimizer, gradient_copies=1)
            if table.sparse_grad:  # only the touched rows' gradients
                part = MemoryEstimate(part.parameters, 0, part.optimizer_state, 0)
            estimate += part
    for name in pulled_whole:  # ps/optps: a fresh copy every step, no state here
        whole = user_params[name]
        estimate += MemoryEstimate(parameters=whole.numel() * whole.element_size())
    buffers = sum(b.numel() * b.element_size() for b in module.buffers())
    return estimate + MemoryEstimate(buffers=buffers)
