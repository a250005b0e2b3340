"""The forward of the module that runs: before it, the rows of every server-held table it will
read are pulled in one exchange (the sync mode's ``prefetch``): all of a ps model's dense
parameters, and the sparse lookups whose ids the id program (`parallax.model.lookahead`)
computes from the inputs; a lookup the program cannot foresee pulls its rows itself.

A world of one whose every table is the program's own parameter runs `ProgramForward`
instead: the program's module itself, nothing pulled, looked ahead or mirrored.

Also the batch helpers the runner needs (device moves, target counts, shapes).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from parallax.engine.diagnostics.phases import PhaseClock
from parallax.engine.tables import pooled
from parallax.engine.tables.layout import Layout
from parallax.engine.tables.own import OwnTable
from parallax.engine.tables.own_summed import SummedOwnTable
from parallax.engine.tables.table import Table
from parallax.errors import ArgumentError, ArgumentTypeError
from parallax.model.lookahead import IdProgram, traced_id_program
from parallax.model.stand_ins import (
    Mirror,
    RetracedRoot,
    ShardedEmbedding,
    ShardedEmbeddingBag,
    ShardedGather,
    bag_shaped,
    table_read_by,
)
from parallax.model.trace_reads import TraceCache
from parallax.step.sync_modes import SyncMode

__all__ = ["Forward", "Meet", "ProgramForward", "call_to_device", "checked_loss", "evaluating",
           "mean_loss", "numel", "shapes", "to_device"]

#: the loop order's check of a forward (`parallax.step.loop_order.LoopOrder.meet`, its call
#: and step given): with numbers, every rank's (collective on every rank); with None, the
#: check alone
Meet = Callable[[Sequence[float] | None], list[list[float]]]


class Forward:
    """``forward(args, kwargs)``: the output of ``module()`` (the executed copy, under DDP
    where the dense sync uses it) for the inputs, with its rows pulled ahead; ``mirror``
    brings the program's module attributes to the copies before, and back after."""

    def __init__(self, executed: nn.Module, module: Callable[[], nn.Module], layout: Layout,
                 params: dict[str, nn.Parameter], *, mirror: Mirror, sync_mode: SyncMode,
                 phases: PhaseClock, device: torch.device) -> None:
        self.executed = executed
        self.mirror = mirror
        self.module = module
        self.sync_mode = sync_mode
        self.phases = phases
        self.layout = layout
        # All lookups' ids from the inputs, when the model allows: one pull for all tables
        # (one program per state of the Python values its trace read, e.g. the mode)
        self._id_programs = (TraceCache(partial(traced_id_program, executed),
                                        what="the id look-ahead", same=IdProgram.same)
                             if layout.sparse else None)
        # ps/optps: dense parameters too come from the servers, whole, each step
        self.whole_pulls = {name: (table, torch.arange(table.num_rows, device=device),
                                   params[name].shape)
                            for name, table in layout.pulled_whole.items()}

    @property
    def id_program(self) -> IdProgram | None:
        """The id program for the modules' state now (None: lookups pull one by one)."""
        return self._id_programs.get() if self._id_programs is not None else None

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any], meet: Meet) -> Any:
        self.mirror()
        with self._pulled_ahead(args, kwargs, meet), self.phases.phase("forward"):
            output = self._run(args, kwargs)
        self.mirror.back()  # what the forward set on the copies it ran: the program's
        return output

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self.whole_pulls:
            return self.module()(*args, **kwargs)
        pulled = {name: table.lookup(rows)[0].view(shape)
                  for name, (table, rows, shape) in self.whole_pulls.items()}
        module = self.module()
        if isinstance(module, RetracedRoot):  # (the parameters under the program's names)
            module = module.select()
        return torch.func.functional_call(module, pulled, args, kwargs)

    def _pulled_ahead(self, args: tuple[Any, ...], kwargs: dict[str, Any], meet: Meet,
                      ) -> contextlib.ExitStack:
        """Meet the other ranks (``meet``: the loop order's check of this forward, which
        carries the summed tables' bad ids where the look-ahead found their lookups), then
        pull the rows this forward will read; inside, lookups read them."""
        wanted: dict[str, tuple[Table, list[Tensor]]] = {}
        bags: list[pooled.BagCall] = []
        summed: dict[SummedOwnTable, list[Tensor]] = {}
        # (no table on the servers or summed, e.g. a world of one's own tables: nothing to
        # look ahead for)
        program = (self.id_program if any([t.on_servers or type(t) is SummedOwnTable
                                            for t in self.layout.sparse.values()]) else None)
        if program is not None:
            with self.phases.phase("id look-ahead"):
                for path, ids, bag_args in program(*args, **kwargs):
                    layer = _submodule(self.executed, path)
                    table = table_read_by(layer)
                    held = table.held
                    if held is not None and held.sharding.pools:
                        if isinstance(layer, ShardedEmbeddingBag) and bag_args is not None:
                            bags.append(pooled.bag_call(
                                held, ids, *bag_args, mode=layer.mode,
                                padding_idx=layer.padding_idx,
                                include_last_offset=layer.include_last_offset))
                        elif _rows_summed_or_averaged(layer, ids):
                            # (an nn.Embedding's or a gather's rows, only summed or averaged
                            # over each row of ids: `parallax.model.bag_reductions`)
                            bags.append(pooled.rows_ahead_call(held, ids))
                    elif table.on_servers:  # replicated tables look up locally
                        wanted.setdefault(table.name, (table, []))[1].append(ids)
                    elif type(table) is SummedOwnTable:  # (its ids agreed below)
                        summed.setdefault(table, []).append(ids)
        for name, (table, rows, _) in self.whole_pulls.items():
            wanted[name] = (table, [rows])
        stack = contextlib.ExitStack()
        if summed:
            stack.enter_context(SummedOwnTable.agree_ahead(summed, meet))
        else:
            meet(None)
        if wanted:
            stack.enter_context(self.sync_mode.prefetch(
                [table for table, _ in wanted.values()], [ids for _, ids in wanted.values()]))
        if bags:
            with self.phases.phase("pool"):
                pooled.pool_ahead(bags)
            stack.callback(_forget_pooled_ahead, bags)
        return stack


def _submodule(root: nn.Module, path: str) -> nn.Module:
    """``root.get_submodule(path)`` by the modules' own registries (a lookup per level, not
    ``get_submodule``'s attribute machinery: the look-ahead asks for every lookup of every
    step); ``get_submodule`` itself, for its error, where a level is not a registered module."""
    module = root
    for name in path.split(".") if path else ():
        found = module._modules.get(name)
        if found is None:
            return root.get_submodule(path)
        module = found
    return module


class ProgramForward:
    """The forward of a world of one whose every table is the program's own parameter
    (`parallax.engine.tables.own`), with no split layer and no DDP: the program's module
    runs as it is, its layers reading their own weights, as on one device. An id outside a
    table fails in the layer's read, as there, and is named as the servers name it
    (`OwnTable.bad_id`)."""

    def __init__(self, model: nn.Module, tables: Iterable[OwnTable], *,
                 phases: PhaseClock) -> None:
        self.model = model
        self.phases = phases
        self._tables = {id(table.param): table for table in tables}

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any], meet: Meet) -> Any:
        meet(None)  # (a world of one: nothing to meet)
        with self.phases.phase("forward"):
            try:
                return self.model(*args, **kwargs)
            except IndexError as error:
                named = _bad_id_named(error, self._tables)
                if named is None:
                    raise
                raise named from error


_READS = (F.embedding.__code__, F.embedding_bag.__code__)  # a layer's read of its weight


def _bad_id_named(error: IndexError, tables: dict[int, OwnTable]) -> Exception | None:
    """The table's own error for an id outside it, where ``error`` came from a read of a
    table's weight (`F.embedding` / `F.embedding_bag` over it, on the CPU); None otherwise."""
    trace = error.__traceback__
    while trace is not None:
        frame = trace.tb_frame
        if frame.f_code in _READS:
            ids, weight = frame.f_locals.get("input"), frame.f_locals.get("weight")
            table = tables.get(id(weight))
            found = table.named_bad_id(ids) if table is not None else None
            if found is not None:
                return found
        trace = trace.tb_next
    return None


def _rows_summed_or_averaged(layer: nn.Module, ids: Tensor) -> bool:
    """Whether a lookup of a pooling table by ``layer`` returns rows whose sums or means the
    owners pool (`parallax.model.stand_ins`: an ``nn.Embedding`` without ``padding_idx`` or a
    gather, with ids of batch x bag; any other such lookup is refused in the forward). A
    gather's ``padding_idx`` comes with its call, refused there when given."""
    if isinstance(layer, ShardedEmbedding):
        return bag_shaped(ids, layer.padding_idx)
    return isinstance(layer, ShardedGather) and bag_shaped(ids, None)


def _forget_pooled_ahead(calls: list[pooled.BagCall]) -> None:
    """After the forward: calls pooled ahead that it did not make are dropped (their
    gradients, none, are still pushed as zeros)."""
    for call in calls:
        call.table.steps.forward_done([call.table.name])


def checked_loss(loss: Any, rank: int) -> Tensor:
    """``loss_fn``'s result for `Runner.step`: one value with autograd, or a clear error."""
    if type(loss) is not Tensor and not isinstance(loss, Tensor):  # (type: no call a step)
        raise ArgumentTypeError(
            f"rank {rank}: get_runner's loss_fn returned {type(loss).__name__}, Runner.step "
            f"needs the loss alone (a one-value tensor): return it alone and compute metrics "
            f"from runner.forward(...) or in your own loop (parallax.distribute)")
    if loss.numel() != 1 or not loss.requires_grad:
        raise ArgumentError(
            f"rank {rank}: get_runner's loss_fn returned a tensor of shape "
            f"{tuple(loss.shape)}{'' if loss.requires_grad else ' without autograd'}; "
            f"Runner.step needs one value computed from the model's output (a mean or sum "
            f"reduction)")
    return loss


def mean_loss(forward: Callable[[Any], Any], loss_fn: Callable[[Any, Any], Tensor],
              batches: Iterable[Sequence[Any]], *, group: dist.ProcessGroup,
              device: torch.device) -> float:
    """The mean of ``loss_fn`` over the ``(inputs, targets)`` batches of every rank, weighted
    by batch size, without gradients (collective: every rank passes as many batches)."""
    total = torch.zeros(2, dtype=torch.float64, device=device)
    with torch.no_grad():
        for inputs, targets in batches:
            targets = to_device(targets, device)
            loss = loss_fn(forward(inputs), targets)
            count = len(targets)
            total += torch.tensor([float(loss) * count, count], dtype=torch.float64,
                                  device=device)
    dist.all_reduce(total, group=group)
    return float(total[0] / total[1].clamp_min(1))


@contextmanager
def evaluating(*trees: nn.Module) -> Iterator[None]:
    """Every module of ``trees`` in eval mode inside (the user's tree too: `mirror` brings
    its flags to the copies that run); each module's own mode back after."""
    modes = [(module, module.training) for tree in trees for module in tree.modules()]
    for tree in trees:
        tree.eval()
    try:
        yield
    finally:
        for module, mode in modes:
            module.training = mode


def numel(value: Any) -> int:
    """Target elements of a batch's targets (tensors anywhere inside)."""
    if type(value) is Tensor or isinstance(value, Tensor):  # (type: no call a step)
        return value.numel()
    if isinstance(value, dict):
        return sum(numel(v) for v in value.values())
    if isinstance(value, (tuple, list)):
        return sum(numel(v) for v in value)
    return 0


def shapes(value: Any) -> Any:
    """The tensor shapes of a batch (what the search's cache entry is valid for)."""
    if isinstance(value, Tensor):
        return [list(value.shape), str(value.dtype)]
    if isinstance(value, dict):
        return {str(k): shapes(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (tuple, list)):
        return [shapes(v) for v in value]
    return type(value).__name__


def call_to_device(args: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device,
                   ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A call's arguments on ``device`` (`to_device`), with no walk for the usual call: a
    tensor already there, as a positional argument, is itself (a forward makes this call
    every step)."""
    return (tuple([arg if type(arg) is Tensor and arg.device == device
                   else to_device(arg, device) for arg in args]),
            to_device(kwargs, device) if kwargs else kwargs)


def to_device(value: Any, device: torch.device) -> Any:
    """``value``'s tensors (anywhere inside tuples, lists and dicts) on ``device``."""
    if type(value) is Tensor or isinstance(value, Tensor):  # (type: no call a step)
        # (one there already is itself: no operator each step)
        return value if value.device == device else value.to(device)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)([to_device(v, device) for v in value])
    return value
