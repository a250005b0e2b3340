"""The user's own optimizer, applied by each server to its shards of the sparse parameters.

Servers build ``type(optimizer)`` over their shards with the hyper-parameters of the param
group that held the original parameter, and copy those hyper-parameters again before every step,
so an lr scheduler (or any edit of ``param_groups``) on the user's optimizer reaches them too.
This equals the single-device update only for optimizers that act element by element, which is
why the classes are checked.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from parallax.cluster import WorkerInfo
from parallax.collective import agree
from parallax.engine.optimizers import deferred_sgd
from parallax.engine.optimizers.deferred_sgd import DeferredRows, sgd_rows, zero_gradient_map
from parallax.engine.optimizers.group_update import fuse_group_steps
from parallax.engine.optimizers.row_update import RowStep, has_row_update, update_rows
from parallax.engine.tables.pool import SERIAL, PartitionPool
from parallax.errors import (
    ArgumentTypeError,
    InternalError,
    OptimizerError,
    UnsupportedProgramError,
)

# torch's own sparse optimizers (Adagrad, SGD) build sparse tensors without opting in or out of
# invariant checks; the warning says nothing about the user's program.
warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled")

# Optimizers whose update of an element depends only on that element's gradient and state
# (plus per-parameter step counts, which every shard advances exactly as the whole would).
PER_SHARD_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adagrad, torch.optim.Adam, torch.optim.AdamW,
    torch.optim.SparseAdam, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
    torch.optim.RMSprop, torch.optim.Rprop, torch.optim.ASGD, torch.optim.Adadelta,
)


class ServerTable(Protocol):
    """What the servers' optimizer needs of a table
    (`parallax.engine.tables.server_table.ShardedTable`)."""

    name: str
    shard: nn.Parameter | None
    parts: list[nn.Parameter]
    blocks: list[tuple[int, int]]
    worker: WorkerInfo
    group: dist.ProcessGroup
    sparse_grad: bool
    gradient_anywhere: bool  # False: no .grad on one device this step; its update is skipped
    # its optimizer never writes gradients: they are zero outside the touched rows
    grad_zero_elsewhere: bool
    # called with shard rows (None: all) before they are read or written (`catch_up`)
    before_read: Callable[[Tensor | None], None] | None

    def scatter_from_rank0(self, weight: Tensor) -> Tensor: ...

    def touched_rows_by_part(self) -> list[Tensor]: ...


def as_optimizer_list(optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
                      ) -> list[torch.optim.Optimizer]:
    """Accept one optimizer or several (e.g. ``SparseAdam`` for embeddings + ``Adam``)."""
    optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
    for i, opt in enumerate(optimizers):
        if not isinstance(opt, torch.optim.Optimizer):
            raise ArgumentTypeError(f"optimizer[{i}] must be a torch.optim.Optimizer, "
                            f"got {type(opt).__name__}")
    return optimizers


def parameter_ids(optimizers: Sequence[torch.optim.Optimizer]) -> set[int]:
    """The ids of every parameter ``optimizers`` update."""
    ids: set[int] = set()
    for optimizer in optimizers:  # (no Python call per parameter: this runs every step)
        for group in optimizer.param_groups:
            ids.update(map(id, group["params"]))
    return ids


def optimizer_of(optimizers: Sequence[torch.optim.Optimizer],
                 param: Tensor) -> torch.optim.Optimizer | None:
    """The optimizer whose param groups hold ``param`` (None: it is not optimized)."""
    for opt in optimizers:
        if any(p is param for g in opt.param_groups for p in g["params"]):
            return opt
    return None


def check_in_model(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Refuse a parameter an optimizer updates that is not the model's: nothing would
    average its gradient over the workers (each would train its own copy, unlike one
    device)."""
    mine = {id(p) for p in model.parameters()}
    for number, optimizer in enumerate(optimizers):
        for index, group in enumerate(optimizer.param_groups):
            for position, param in enumerate(group["params"]):
                if id(param) not in mine:
                    raise UnsupportedProgramError(
                        f"optimizer {number} ({type(optimizer).__name__}), param group "
                        f"{index}, parameter {position} (shape {tuple(param.shape)}) is not a "
                        f"parameter of the model: nothing would average its gradient over "
                        f"the workers, so each would train its own copy. Register it on the "
                        f"model (e.g. self.scale = nn.Parameter(...) in its __init__) before "
                        f"parallax.distribute / parallax.get_runner")


def check_per_shard(optimizers: Sequence[torch.optim.Optimizer],
                    sparse_params: dict[str, nn.Parameter]) -> None:
    """Raise `OptimizerError` naming the parameter if its optimizer cannot run per shard."""
    for name, param in sparse_params.items():
        opt = optimizer_of(optimizers, param)
        if opt is not None and not isinstance(opt, PER_SHARD_OPTIMIZERS):
            supported = ", ".join(c.__name__ for c in PER_SHARD_OPTIMIZERS)
            raise OptimizerError(
                f"optimizer {type(opt).__name__} cannot be applied per shard to the "
                f"sparse parameter '{name}': its update is not element-wise. "
                f"Supported for sparse parameters: {supported}."
            )


# Optimizers that accept sparse (COO) gradients: what `Config.lazy_sparse_updates` needs.
SPARSE_GRAD_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adagrad, torch.optim.SparseAdam)


def check_lazy(optimizers: Sequence[torch.optim.Optimizer],
               sparse_params: dict[str, nn.Parameter]) -> None:
    """Raise `OptimizerError` naming the parameter if lazy updates cannot apply to it."""
    for name, param in sparse_params.items():
        opt = optimizer_of(optimizers, param)
        if opt is not None and not isinstance(opt, SPARSE_GRAD_OPTIMIZERS):
            raise OptimizerError(
                f"Config(lazy_sparse_updates=True) gives the sparse parameter '{name}' "
                f"sparse gradients, which {type(opt).__name__} does not take; use SGD, "
                f"Adagrad or SparseAdam for it (e.g. SparseAdam for the embeddings and Adam "
                f"for the rest)."
            )


class ShardOptimizer:
    """On a server: the user's optimizer classes over this server's shards, partition by
    partition.

    Server optimizer ``i`` of a user optimizer updates the ``i``-th partition of every table the
    user optimizer holds (with each table's param-group hyper-parameters), so the partitions
    are updated side by side in the `PartitionPool`; with one partition per server there is one
    server optimizer per user optimizer.
    """

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer],
                 tables: dict[int, ServerTable], pool: PartitionPool = SERIAL, *,
                 states: Mapping[str, dict[str, Any]] | None = None):
        """``tables`` maps ``id(original parameter)`` to its table, for the tables with a
        shard on this server; ``states``: by table name, the shard's optimizer state to start
        from (as `table_state` returns it; this call's to keep): the server optimizers are
        built holding it, so a constructor that makes state (Adagrad's) makes none for them
        (it used to, beside the state adopted after: the program-built model's peak)."""
        self.pool = pool
        # Per table: the user optimizer and the index of the param group holding its
        # parameter (an index: load_state_dict replaces the group dicts).
        self._owners: dict[str, tuple[torch.optim.Optimizer, int]] = {}
        self._tables: dict[str, ServerTable] = {}
        for opt in optimizers:
            for index, group in enumerate(opt.param_groups):
                for param in group["params"]:
                    table = tables.get(id(param))
                    if table is not None:
                        self._owners[table.name] = (opt, index)
                        self._tables[table.name] = table
        # (server optimizer, user optimizer, user group index of each server group)
        self._slots: list[tuple[torch.optim.Optimizer, torch.optim.Optimizer, list[int]]] = []
        # per partition under deferred SGD: the steps its untouched rows still owe
        self._deferred: dict[nn.Parameter, DeferredRows] = {}
        self._rebuild({part: part_state
                       for name, state in (states or {}).items() if name in self._tables
                       for part, part_state in _part_states(self._tables[name], state,
                                                            owned=True).items()})
        for name, table in self._tables.items():
            # (``before_read`` is set at the table's first deferred step: until then no row
            # owes one, and a read asks nothing)
            table.before_read = None
            # torch's own optimizers read gradients and never write them
            owner = optimizer_class(self._owners[name][0])
            table.grad_zero_elsewhere = owner in PER_SHARD_OPTIMIZERS

    def _rebuild(self, states: Mapping[Tensor, Any]) -> None:
        """Server optimizers over the tables' current partitions, with ``states`` (keyed by
        partition parameter) carried over."""
        for server_opt, _, _ in self._slots:
            states = {**server_opt.state, **states} if server_opt.state else states
        self._slots = []
        user_optimizers = list(dict.fromkeys(opt for opt, _ in self._owners.values()))
        for user_opt in user_optimizers:
            depth = max(len(self._tables[name].parts) for name, (opt, _) in self._owners.items()
                        if opt is user_opt)
            for slot in range(depth):
                groups, indices = [], []
                for index, user_group in enumerate(user_opt.param_groups):
                    parts = [self._tables[name].parts[slot]
                             for name, (opt, i) in self._owners.items()
                             if opt is user_opt and i == index
                             and slot < len(self._tables[name].parts)]
                    if parts:
                        groups.append({**_hyper_parameters(user_group), "params": parts})
                        indices.append(index)
                server_opt = _constructed(optimizer_class(user_opt), groups,
                                          _constructor_arguments(user_opt), states)
                self._slots.append((server_opt, user_opt, indices))
        live = {part for table in self._tables.values() for part in table.parts}
        self._deferred = {part: rows for part, rows in self._deferred.items() if part in live}

    def step(self, optimizers: Sequence[torch.optim.Optimizer] | None = None) -> None:
        """Apply the update of every user optimizer (or of ``optimizers``) to its rows.

        Where a zero gradient provably leaves a row and its state as they are
        (`zero_gradient_is_identity`), only the rows that received gradient are updated, by
        the optimizer's own functional step on those rows (`update_rows`). Untouched rows
        would have been left unchanged by the dense update too, so the result is the
        dense-gradient program's.

        Under SGD with momentum or weight decay (`deferrable_sgd`) the touched rows take the
        step and the others' steps are deferred (`parallax.engine.optimizers.deferred_sgd`) until
        they are read (`catch_up`)."""
        if not self._tables:  # (none on the servers: a world of one's own tables)
            return
        wanted = None if optimizers is None else {id(o) for o in optimizers}
        slots = [slot for slot in self._slots if wanted is None or id(slot[1]) in wanted]
        for server_opt, user_opt, indices in slots:
            for server_group, index in zip(server_opt.param_groups, indices, strict=True):
                server_group.update(_hyper_parameters(user_opt.param_groups[index]))
        # A table no backward reached has no .grad on one device: torch's step skips it.
        dense_grads = [(part, part.grad) for table in self._tables.values()
                       if not table.gradient_anywhere for part in table.parts]
        for part, _ in dense_grads:
            part.grad = None
        row_steps = self._touched_rows_only(wanted, dense_grads)
        deferred_steps = self._deferred_steps(wanted, dense_grads)
        try:
            # (a server optimizer of torch's own whose every part had its gradient taken
            # would step nothing: its step() is skipped, as torch skips a .grad of None)
            steps: list[Callable[[], object]] = [
                server_opt.step for server_opt, user_opt, _ in slots
                if optimizer_class(user_opt) not in PER_SHARD_OPTIMIZERS
                or _any_gradient(server_opt)]
            self.pool.run([*steps, *row_steps, *deferred_steps])
        finally:
            for part, grad in dense_grads:
                part.grad = grad

    def _eligible(self, wanted: set[int] | None,
                  rule: Callable[[torch.optim.Optimizer, dict[str, Any]], bool],
                  ) -> list[tuple[ServerTable, dict[str, Any]]]:
        """The dense-gradient tables of the wanted optimizers whose param group satisfies
        ``rule``, with the group."""
        eligible = []
        ruled: dict[tuple[int, int], bool] = {}  # (the rule once per param group, not table)
        for name, table in self._tables.items():
            user_opt, index = self._owners[name]
            if table.sparse_grad or (wanted is not None and id(user_opt) not in wanted):
                continue
            group = user_opt.param_groups[index]
            key = (id(user_opt), index)
            if key not in ruled:
                ruled[key] = rule(user_opt, group)
            if ruled[key] and hasattr(table, "touched_rows_by_part"):
                eligible.append((table, group))
        return eligible

    def _deferred_steps(self, wanted: set[int] | None,
                        held: list[tuple[nn.Parameter, Tensor | None]],
                        ) -> list[Callable[[], None]]:
        """The deferred-SGD updates of this step, one task per partition; the partitions'
        gradients are taken from the servers' optimizers (which skip them) into ``held``."""
        tasks = []
        for table, group in self._eligible(wanted, deferrable_sgd):
            hyper = _hyper_parameters(group)
            for part, rows in zip(table.parts, table.touched_rows_by_part(), strict=True):
                if part.grad is None:  # torch skips a parameter without gradient
                    continue
                deferred = self._deferred.setdefault(
                    part, DeferredRows(part.shape[0], part.device))
                if table.before_read is None:  # its rows now owe steps before a read
                    table.before_read = functools.partial(self.catch_up, table)
                tasks.append(self._deferred_step(part, part.grad, rows, hyper, deferred))
                held.append((part, part.grad))
                part.grad = None
        return tasks

    def _deferred_step(self, part: nn.Parameter, grad: Tensor, rows: Tensor, group: dict[str, Any],
                       deferred: DeferredRows) -> Callable[[], None]:
        state = self._optimizer_of(part).state[part]

        def step() -> None:
            buf = state.get("momentum_buffer")
            with torch.no_grad():
                deferred.catch_up(part.data, buf, rows)
                new_buf = sgd_rows(part.data, grad, buf, rows, group)
                if new_buf is not None:
                    state["momentum_buffer"] = new_buf
                deferred.record(zero_gradient_map(group, buf is not None), rows)
                if len(deferred.maps) >= deferred_sgd.FLUSH_EVERY:
                    deferred.flush(part.data, new_buf)
        return step

    def catch_up(self, table: ServerTable, rows: Tensor | None = None) -> None:
        """Apply to ``rows`` of ``table``'s shard (its own row numbers; all when None) the
        deferred SGD steps they owe, before anything reads or writes them."""
        for part, (start, stop) in zip(table.parts, table.blocks, strict=True):
            deferred = self._deferred.get(part)
            if deferred is None or not deferred.pending:
                continue
            mine = rows
            if rows is not None and len(table.parts) > 1:
                mine = rows[(rows >= start) & (rows < stop)] - start
            with torch.no_grad():
                deferred.catch_up(part.data, self._state_of(part).get("momentum_buffer"), mine)

    def _optimizer_of(self, part: nn.Parameter) -> torch.optim.Optimizer:
        for server_opt, _, _ in self._slots:
            if any(p is part for group in server_opt.param_groups for p in group["params"]):
                return server_opt
        raise InternalError(f"parallax internal error: a part of shape {tuple(part.shape)} is "
                            f"in no server optimizer; please report it")

    def _touched_rows_only(self, wanted: set[int] | None,
                           held: list[tuple[nn.Parameter, Tensor | None]],
                           ) -> list[Callable[[], None]]:
        """The updates of each eligible partition's touched rows alone (`update_rows`), one
        task per param group and partition slot (every table of the group at once, as torch
        steps a group); their dense gradients are taken from the servers' optimizers (which
        skip them) into ``held``, to put back after the step."""
        batched: dict[tuple[int, int], tuple[type[torch.optim.Optimizer], dict[str, Any],
                                             list[tuple[ServerTable, RowStep]]]] = {}
        for table, group in self._eligible(wanted, zero_gradient_is_identity):
            cls = optimizer_class(self._owners[table.name][0])  # (a group's rule holds: cheap)
            for slot, (part, rows) in enumerate(zip(table.parts, table.touched_rows_by_part(),
                                                    strict=True)):
                grad = part.grad
                if (grad is None or grad.is_sparse or rows.numel() == part.shape[0]
                        or not has_row_update(cls, part)):
                    continue
                key = (id(group), slot)
                if key not in batched:
                    batched[key] = (cls, _hyper_parameters(group), [])
                batched[key][2].append((table, RowStep(part, grad, rows, self._state_of(part))))
                held.append((part, grad))
                part.grad = None
        return [functools.partial(_update, cls, hyper, entries)
                for cls, hyper, entries in batched.values()]

    def _state_of(self, part: nn.Parameter) -> dict[str, Any]:
        for server_opt, _, _ in self._slots:
            if part in server_opt.state:
                state: dict[str, Any] = server_opt.state[part]
                return state
        return {}

    def table_state(self, table: ServerTable) -> dict[str, Any]:
        """The optimizer state of ``table``'s whole shard (empty before its first step):
        per-row tensors of its partitions joined in shard order, the rest (step counts) as
        its first partition has them. Deferred steps are applied first."""
        self.catch_up(table)
        states = [self._state_of(part) for part in table.parts]
        if not states[0]:
            return {}
        joined = dict(states[0])
        for key, value in states[0].items():
            if is_per_row(value, table.parts[0]):
                joined[key] = torch.cat([state[key] for state in states])
        return joined

    def per_row_state(self, table: ServerTable) -> list[Tensor]:
        """The per-row tensors of the optimizer state of ``table``'s partitions as held now
        (a move frees them once it has read them: `parallax.partitions.repartition`)."""
        return [value for part in table.parts for value in self._state_of(part).values()
                if is_per_row(value, part)]

    def remove_table(self, table: ServerTable) -> dict[str, Any]:
        """Stop updating ``table``; return its shard's optimizer state (for moving it)."""
        state = self.table_state(table)
        parts = {id(part) for part in table.parts}
        del self._owners[table.name], self._tables[table.name]
        table.before_read = None
        table.grad_zero_elsewhere = False
        kept = {p: s for server_opt, _, _ in self._slots for p, s in server_opt.state.items()
                if id(p) not in parts}
        self._slots = []
        self._rebuild(kept)
        return state

    def adopt_user_state(self, table: ServerTable, param: nn.Parameter,
                         optimizers: Sequence[torch.optim.Optimizer],
                         taken: dict[str, Any] | None = None) -> None:
        """Move the state the user's optimizer holds for ``param`` to the servers
        (`take_user_state`, unless ``taken`` is what it returned earlier). Collective over
        the table's group unless ``taken`` is given."""
        state = take_user_state(table, param, optimizers) if taken is None else taken
        if state and table.shard is not None:
            self.set_table_state(table, state)

    def set_table_state(self, table: ServerTable, state: dict[str, Any]) -> None:
        """Replace the optimizer state of ``table``'s shard (a checkpoint's), ``{}`` for a
        fresh one. The rows' deferred steps are applied first (with the state they had)."""
        self.catch_up(table)
        for part in table.parts:
            self._deferred.pop(part, None)
        parts = {id(part) for part in table.parts}
        for server_opt, _, _ in self._slots:
            for stale in [p for p in server_opt.state if id(p) in parts]:
                del server_opt.state[stale]
        self.table_repartitioned(table, state)

    def table_repartitioned(self, table: ServerTable, state: dict[str, Any], *,
                            owned: bool = False) -> None:
        """Update ``table``'s new partitions from now on, with its shard's optimizer ``state``
        (as `table_state` returned it, rows already in the new shard's order). ``owned``: its
        per-row tensors are this call's to keep (read for it, referenced nowhere else), so a
        shard of one partition holds them as they are rather than a copy beside them."""
        self._rebuild(_part_states(table, state, owned=owned))


def _update(optimizer_class: type[torch.optim.Optimizer], group: dict[str, Any],
            entries: Sequence[tuple[ServerTable, RowStep]]) -> None:
    """`update_rows` of one param group's row steps, a table group's members as one
    (`parallax.engine.optimizers.group_update`)."""
    steps, after = fuse_group_steps(optimizer_class, entries)
    update_rows(optimizer_class, group, steps)
    for finish in after:
        finish()


def _part_states(table: ServerTable, state: dict[str, Any], *,
                 owned: bool) -> dict[Tensor, Any]:
    """``table``'s whole-shard optimizer ``state`` (`ShardOptimizer.table_state`'s form) as
    each of its partitions' state; ``owned``: a shard of one partition keeps the per-row
    tensors as they are (else each partition holds its own copy of its rows)."""
    states: dict[Tensor, Any] = {}
    if state:
        whole = owned and len(table.parts) == 1
        for part, (start, stop) in zip(table.parts, table.blocks, strict=True):
            states[part] = {
                key: ((value if whole else value[start:stop].clone())
                      if is_per_row(value, table.shard)
                      else value.clone() if isinstance(value, Tensor) else value)
                for key, value in state.items()}
    return states


#: optimizer classes whose constructor makes each parameter's state (Adagrad's accumulators)
_EAGER_STATE: tuple[type[torch.optim.Optimizer], ...] = (torch.optim.Adagrad,)


def _constructed(cls: type[torch.optim.Optimizer], groups: list[dict[str, Any]],
                 arguments: dict[str, Any], states: Mapping[Tensor, Any],
                 ) -> torch.optim.Optimizer:
    """``cls(groups, **arguments)`` whose parameters found in ``states`` hold that state. A
    constructor that makes every parameter's state itself (`_EAGER_STATE`) is given
    storage-less stand-ins of those parameters and the real ones after: it would otherwise
    allocate a second copy of every carried state beside it (moving one table onto its
    owner rebuilds the server optimizers over all of a server's tables: that copy was the
    move's peak memory). The others' state comes from the constructor as usual."""
    eager = issubclass(cls, _EAGER_STATE)
    stand_ins = {part: nn.Parameter(torch.empty_like(part, device="meta"),
                                    requires_grad=part.requires_grad)
                 for group in groups for part in group["params"]
                 if eager and part in states}
    built = cls([{**group, "params": [stand_ins.get(part, part) for part in group["params"]]}
                 for group in groups], **arguments)
    made = dict(built.state)
    built.state.clear()
    for group, given in zip(built.param_groups, groups, strict=True):
        group["params"] = list(given["params"])
        for part in group["params"]:
            if part in states:
                built.state[part] = states[part]
            elif part in made:
                built.state[part] = made[part]
    return built


def take_user_state(table: ServerTable, param: nn.Parameter,
                    optimizers: Sequence[torch.optim.Optimizer]) -> dict[str, Any]:
    """The state the user's optimizer holds for ``param`` (loaded from a single-device
    checkpoint, or made by its constructor, as Adagrad's accumulators), rank 0's, as this
    server's rows (`ShardOptimizer.adopt_user_state` hands it to the servers' optimizer); the
    user's object keeps none (the servers' is the one that trains), so its memory goes now.
    Collective over the table's group."""
    owner = optimizer_of(optimizers, param)
    mine = dict(owner.state.pop(param, {})) if owner is not None else {}
    if any(_is_meta(value) for value in mine.values()):
        # made by the constructor for a parameter built in parallax.meta_init: the
        # servers' optimizers, built with the same arguments, made their own
        mine = {}
    rank = table.worker.rank
    layout = agree({key: ("rows" if is_per_row(value, param) else value)
                    for key, value in mine.items()}, rank=rank, group=table.group)
    if rank != 0:  # only rank 0's values are scattered: the others' go before any row is made
        mine = {key: torch.empty_like(value, device="meta") if isinstance(value, Tensor)
                else value for key, value in mine.items()}
    state: dict[str, Any] = {}
    for key, kind in layout.items():
        if isinstance(kind, str) and kind == "rows":
            # (popped: rank 0's entry goes as soon as its rows are scattered)
            state[key] = table.scatter_from_rank0(mine.pop(key, param).detach())
        else:
            state[key] = kind.clone() if isinstance(kind, Tensor) else kind
    return state


def _any_gradient(optimizer: torch.optim.Optimizer) -> bool:
    """Whether any parameter of ``optimizer`` has a gradient (loops: every step asks)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is not None:
                return True
    return False


def is_per_row(value: object, rows: Tensor | None) -> bool:
    """Whether optimizer-state entry ``value`` holds one entry per row of ``rows`` (a shard, a
    partition or a whole parameter): a tensor of its very shape, which moves, splits and joins
    with the rows (Adam's moments), unlike scalars and step counts. False for every value when
    there are no rows (None: a rank that holds no shard)."""
    return isinstance(value, Tensor) and rows is not None and value.shape == rows.shape


def zero_gradient_is_identity(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> bool:
    """Whether a step with a zero gradient leaves a parameter element and its optimizer
    state exactly unchanged, for this optimizer's class and ``group``'s hyper-parameters:
    plain SGD (no momentum, no weight decay) and Adagrad without weight decay (any lr_decay,
    eps, initial accumulator); not the fused kernels, nor subclasses (their steps may
    differ). Everything else (momentum, weight decay, Adam's moment decay) moves untouched
    rows too, and keeps the dense update."""
    cls = optimizer_class(optimizer)
    if group.get("weight_decay", 0) != 0 or group.get("fused"):
        return False
    if cls is torch.optim.SGD:
        return bool(group.get("momentum", 0) == 0)
    return cls is torch.optim.Adagrad


def deferrable_sgd(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> bool:
    """Whether the steps of rows with a zero gradient can be deferred and applied later in
    closed form (`parallax.engine.optimizers.deferred_sgd`): torch's own SGD (not a subclass, not
    fused or differentiable) with momentum or weight decay; without either a zero gradient changes
    nothing (`zero_gradient_is_identity`)."""
    return (optimizer_class(optimizer) is torch.optim.SGD and not group.get("fused")
            and not group.get("differentiable")
            and (group.get("momentum", 0) != 0 or group.get("weight_decay", 0) != 0))


def local_state_dict(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` of the object itself: for a `parallax.distribute` optimizer,
    its class's own (not the collective one that gathers the servers' state)."""
    return optimizer_class(optimizer).state_dict(optimizer)


def local_load_state_dict(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """``optimizer.load_state_dict(state)`` of the object itself (see `local_state_dict`)."""
    optimizer_class(optimizer).load_state_dict(optimizer, state)


def optimizer_class(optimizer: torch.optim.Optimizer) -> type[torch.optim.Optimizer]:
    """The user's optimizer class (the one a `parallax.distribute` optimizer wraps)."""
    return getattr(type(optimizer), "parallax_base", type(optimizer))


def rebuild_constructor_state(optimizers: Sequence[torch.optim.Optimizer],
                              param: nn.Parameter) -> None:
    """``param`` now has values (built in parallax.meta_init, kept whole): replace the
    storage-less state its optimizer's constructor made for it (Adagrad's accumulators) by
    what that constructor makes for a real tensor."""
    owner = optimizer_of(optimizers, param)
    if owner is None or not any(_is_meta(v) for v in owner.state.get(param, {}).values()):
        return
    group = next(g for g in owner.param_groups if any(p is param for p in g["params"]))
    fresh = optimizer_class(owner)([{**_hyper_parameters(group), "params": [param]}],
                                   **_constructor_arguments(owner))
    owner.state.pop(param)
    if param in fresh.state:
        owner.state[param] = fresh.state[param]


def state_to_params_device(optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Move each optimizer's state to its parameter's device, after the model moved (a
    program builds its model and optimizer on the CPU; Adagrad's constructor already made its
    sums there). The rule is `torch.optim.Optimizer.load_state_dict`'s: a ``step`` count
    stays where it is unless the group is ``capturable`` or ``fused`` (torch's non-capturable
    kernels want it on the CPU); every other tensor follows the parameter."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            keep_step = not (group.get("capturable") or group.get("fused"))
            for param in group["params"]:
                state = optimizer.state.get(param)
                if not state or param.device.type == "meta":
                    continue
                for key, value in state.items():
                    if (isinstance(value, Tensor) and value.device != param.device
                            and value.device.type != "meta"
                            and not (key == "step" and keep_step)):
                        state[key] = value.to(param.device)


def _is_meta(value: object) -> bool:
    return isinstance(value, Tensor) and value.device.type == "meta"


def _constructor_arguments(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The user's constructor arguments as ``defaults`` records them, for those the class's
    constructor takes: some act in the constructor itself (Adagrad fills its state with
    ``initial_accumulator_value`` there), so param groups alone would not reproduce them."""
    try:
        accepted = inspect.signature(optimizer_class(optimizer)).parameters
    except (TypeError, ValueError):
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        return {}  # cannot tell which keys it takes
    return {key: value for key, value in optimizer.defaults.items()
            if key in accepted and key != "params"}


def _hyper_parameters(group: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in group.items() if key != "params"}
