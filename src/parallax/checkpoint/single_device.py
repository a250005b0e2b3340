"""The running job seen as the single-device program: the plain ``state_dict`` of the user's
model class and the plain ``optimizer.state_dict()``, out (gathered from the servers) and in
(each server takes its rows), and the streamed export. Apart from the training machinery: it
reads the tables and the servers' optimizer state through their contracts and never steps.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from parallax.checkpoint.export import export_running
from parallax.cluster import WorkerInfo
from parallax.collective import first_difference
from parallax.engine.optimizers.shard_optimizer import (
    ShardOptimizer,
    is_per_row,
    local_load_state_dict,
    local_state_dict,
)
from parallax.engine.tables import handles
from parallax.engine.tables.server_table import ShardedTable
from parallax.engine.tables.table import Table, held_tables
from parallax.errors import OptimizerError, UnsupportedProgramError, UsageError
from parallax.parallelism import Parallelism

__all__ = ["SingleDeviceView"]

Scope = Callable[[], contextlib.AbstractContextManager[None]]


class SingleDeviceView:
    """Every method is collective. ``tables`` gives the current tables by parameter name;
    ``quiet`` a consistent snapshot of the servers (asynchronous training), ``serving_global``
    the trained dense values in the model (Plump-/Slim-DP: ``swaps_dense_values``, this
    worker's own come back after), ``check_export`` the loop-order check of an export
    (`parallax.distribute`)."""

    def __init__(self, model: nn.Module, params: dict[str, nn.Parameter],
                 tables: Callable[[], dict[str, Table]], parallelism: Parallelism,
                 shard_optimizer: ShardOptimizer, *, worker: WorkerInfo,
                 group: dist.ProcessGroup, device: torch.device, quiet: Scope,
                 serving_global: Scope, swaps_dense_values: bool,
                 check_export: Callable[[], None]) -> None:
        self.model = model
        self.params = params
        self.tables = tables
        self.parallelism = parallelism
        self.shard_optimizer = shard_optimizer
        self.worker = worker
        self.group = group
        self.device = device
        self.quiet = quiet
        self.serving_global = serving_global
        self.swaps_dense_values = swaps_dense_values
        self.check_export = check_export

    # ---- the model ---------------------------------------------------------------------------
    def state_dict(self, *, whole: bool = True) -> dict[str, Tensor]:
        """A plain single-device ``state_dict`` of the original model class; with
        ``whole=False`` model parallelism's split weights stay this rank's DTensor shards."""
        self.check_export()
        with self.quiet():
            with self.serving_global():
                state = self.model.state_dict()
                state = (self.parallelism.plain_model_state(state) if whole
                         else self.parallelism.sharded_model_state(state))
                if self.swaps_dense_values:  # the parameters get this worker's values back
                    state = {k: v.clone() for k, v in state.items()}
            aliases = self._aliases()
            for name, table in self.tables().items():
                full = table.full_weight().view(state[name].shape).to(self.device)
                for alias in aliases[id(self.params[name])]:
                    state[alias] = full
        return state

    def export(self, path: str | os.PathLike[str]) -> Path | None:
        """Write the plain ``state_dict`` to ``path`` on rank 0, streamed: each server-held
        table comes from its servers in chunks of rows written straight into the file
        (`parallax.checkpoint.streamed`). Returns ``path`` on rank 0, None elsewhere."""
        self.check_export()
        held = held_tables(self.tables())
        aliases = self._aliases()
        names = {name: aliases[id(self.params[name])] for name in held}
        with self.serving_global(), self.quiet():
            return export_running(path,
                                  self.parallelism.plain_model_state(self.model.state_dict()),
                                  held, names, rank=self.worker.rank)

    def load_state_dict(self, state: dict[str, Tensor], *, strict: bool = True) -> Any:
        """Load a plain ``state_dict`` (every rank passes the same values): into the model,
        and the server-held rows onto their servers. Returns what
        ``nn.Module.load_state_dict`` returns."""
        with self.quiet():
            return self._load_state_dict(state, strict=strict)

    def _load_state_dict(self, state: dict[str, Tensor], *, strict: bool) -> Any:
        differs = first_difference(state, rank=self.worker.rank, world=self.worker.world_size,
                                   group=self.group)
        if differs is not None:  # the replicas would silently part ways
            other, key = differs
            raise UnsupportedProgramError(
                f"{handles.program_line()}: load_state_dict: rank {other} passed a different "
                f"{key!r} than rank 0 (or "
                f"only one of them has it); every rank must load the same values. A file "
                f"read while rank 0 was still writing it? Call torch.distributed.barrier() "
                f"after saving on rank 0, before other ranks read the file")
        held_aliases = self._held_aliases()
        held = {name for names in held_aliases.values() for name in names}
        state = self.parallelism.load_plain_model_state(state)  # the split layers' shards
        result = self.model.load_state_dict({k: v for k, v in state.items() if k not in held},
                                            strict=False)
        missing = [k for k in result.missing_keys
                   if k not in held and k not in self.parallelism.sharded]
        missing += sorted(k for k in held if k not in state)
        if strict and (missing or result.unexpected_keys):
            raise UsageError(
                f"Error(s) in loading state_dict for {type(self.model).__name__}: missing "
                f"keys {missing}, unexpected keys {result.unexpected_keys}")
        for name, table in self.tables().items():
            given = [alias for alias in held_aliases.get(id(self.params[name]), ())
                     if alias in state]
            if given:
                table.assign(state[given[0]].to(self.device))
        return result.__class__(missing, result.unexpected_keys)

    # ---- an optimizer ------------------------------------------------------------------------
    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """``optimizer.state_dict()`` as on one device: the state of its server-held
        parameters is gathered from the servers, each per-row tensor whole on every rank."""
        with self.quiet():
            state = self.parallelism.plain_optimizer_state(optimizer,
                                                           local_state_dict(optimizer))
            state["state"] = dict(state["state"])
            index = _indices(optimizer)
            for name, table in self._held_by(optimizer, index):
                param = self.params[name]
                entry = self._gathered_state(table, param)
                if entry:
                    state["state"][index[id(param)]] = entry
        return state

    def _gathered_state(self, table: ShardedTable, param: nn.Parameter) -> dict[str, Any]:
        """The servers' optimizer state of ``table``'s rows, whole (collective)."""
        shard_state = (self.shard_optimizer.table_state(table)
                       if table.shard is not None else {})
        mine = {key: ("rows" if is_per_row(value, table.shard) else value)
                for key, value in shard_state.items()}
        everyone: list[Any] = [None] * self.worker.world_size
        dist.all_gather_object(everyone, mine, group=self.group)
        kinds: dict[str, Any] = next((kinds for kinds in everyone if kinds), {})  # a server's
        entry = {}
        for key, kind in kinds.items():
            if isinstance(kind, str) and kind == "rows":
                entry[key] = table.full_weight(shard_state.get(key)).view(param.shape)
            else:
                entry[key] = kind
        return entry

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str,
                                  Any]) -> None:
        """``optimizer.load_state_dict(state)`` of a single-device state dict (every rank
        passes the same): each server takes its rows of a server-held parameter's state,
        the optimizer object the rest."""
        with self.quiet():
            index = _indices(optimizer)
            key_of = _saved_keys(optimizer, state)
            kept = dict(state["state"])
            for name, table in self._held_by(optimizer, index):
                param = self.params[name]
                entry = kept.pop(key_of[id(param)], None) or {}
                if table.shard is None:
                    continue
                self.shard_optimizer.set_table_state(table, {
                    key: table.own_rows(value) if is_per_row(value, param) else value
                    for key, value in entry.items()})
            local_load_state_dict(optimizer, {**state, "state": kept})
            self.parallelism.distribute_optimizer_state(optimizer)

    # ---- names -------------------------------------------------------------------------------
    def _held_by(self, optimizer: torch.optim.Optimizer,
                 index: dict[int, int]) -> list[tuple[str, ShardedTable]]:
        """The server-held tables whose parameters ``optimizer`` updates (`Table.held`)."""
        return [(name, held) for name, held in held_tables(self.tables()).items()
                if id(self.params[name]) in index]

    def _aliases(self) -> dict[int, list[str]]:
        """Per parameter (by id), every name it has in the state dict (tied ones several)."""
        names_of: dict[int, list[str]] = {}
        for name, param in self.model.named_parameters(remove_duplicate=False):
            names_of.setdefault(id(param), []).append(name)
        return names_of

    def _held_aliases(self) -> dict[int, tuple[str, ...]]:
        """Per server-held parameter (by id), every name it has in the state dict."""
        ids = {id(self.params[name]) for name, t in self.tables().items() if t.on_servers}
        return {key: tuple(names) for key, names in self._aliases().items() if key in ids}


def _saved_keys(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[int, Any]:
    """Parameter id -> the key of its entry in ``state["state"]``, matched by position in the
    param groups as ``Optimizer.load_state_dict`` matches them: the keys are indices in a
    plain ``state_dict()``, but names (``embedding.weight``) in the one DCP's
    ``set_state_dict`` hands over."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    saved = [key for group in state.get("param_groups", []) for key in group["params"]]
    if len(saved) != len(params):
        raise OptimizerError(f"the optimizer state dict has {len(saved)} parameters in its "
                         f"param_groups, this optimizer {len(params)}: not a state dict of "
                         f"this optimizer")
    return {id(p): key for p, key in zip(params, saved, strict=True)}


def _indices(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """Parameter id -> its index in ``optimizer``'s state dicts (param groups in order)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {id(p): i for i, p in enumerate(params)}
