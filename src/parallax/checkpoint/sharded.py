"""Sharded checkpoints of a training run (`Run`, which a `Runner` is): every server writes its
own rows, rank 0 the rest.

A checkpoint of step ``s`` is the directory ``<root>/step-<s>`` (`parallax.checkpoint.files`):

* ``tables/<name>/server-<k>.pt``, written by server ``k`` for each table it holds: the global
  ids of its rows, their values, the per-row optimizer state and the scalar state (step
  counts). Tables replicated on the workers (AllReduce/AllGatherv) are written by rank 0 the
  same way (``replica.pt``), so every table has one format whatever its placement was;
* ``dense.pt`` (rank 0): the model's other entries and the user's optimizers' state dicts;
* ``rng/rank-<r>.pt``: each rank's random generator states; ``extra.pt``: the caller's extra;
* ``manifest.json`` last (rank 0), after every rank reported its files and their checksums:
  step, parameters, tables, config, cluster shape, data position.

Because rows are stored with their global ids, a checkpoint loads on any cluster shape and
partition count: each server reads the rows it owns under the *new* partitioning.
"""

from __future__ import annotations

import logging
import os
import random
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from parallax.checkpoint.files import (
    CheckpointError,
    FileRecord,
    Manifest,
    find_checkpoint,
    load_object,
    prune,
    read_manifest,
    save_object,
    step_dir,
    write_manifest,
)
from parallax.cluster import WorkerInfo
from parallax.collective import agree
from parallax.config import Config
from parallax.engine.optimizers.shard_optimizer import (
    ShardOptimizer,
    is_per_row,
    local_load_state_dict,
    local_state_dict,
    optimizer_of,
)
from parallax.engine.tables.handles import is_released, release, restore
from parallax.engine.tables.layout import Layout
from parallax.engine.tables.server_table import ShardedTable
from parallax.engine.tables.table import Table
from parallax.parallelism import Parallelism
from parallax.runs import TrainingRun


class Run(Protocol):
    """The narrow view of a training run that checkpoints save and restore (a `Run` is
    one): the user's model and optimizers, the tables with their server-side optimizer
    state, where this worker stands, and the group every rank of the run is in."""

    model: nn.Module
    optimizers: list[torch.optim.Optimizer]
    config: Config
    worker: WorkerInfo
    global_step: int
    layout: Layout
    shard_optimizer: ShardOptimizer
    group: dist.ProcessGroup
    parallelism: Parallelism
    training_run: TrainingRun  # whose parallax.shard loaders the checkpoint holds

__all__ = ["CheckpointError", "load", "save"]

log = logging.getLogger("parallax")
FORMAT = "parallax-checkpoint"


# ---- saving ------------------------------------------------------------------------------------
def save(runner: Run, root: str | os.PathLike[str], *, keep: int | None = None,
         extra: Any = None) -> Path:
    """Write step ``runner.global_step`` under ``root`` (collective). A failure on any rank
    raises on every rank and writes no manifest: the previous checkpoint stays the newest."""
    worker = runner.worker
    directory = step_dir(root, runner.global_step)
    records: dict[str, FileRecord] = {}
    error = None
    try:
        records.update(_save_rank_files(runner, directory, extra))
    except Exception as failure:  # reported on every rank below, not left to hang them
        # the cause first: the launcher's one-line summary of a long message keeps its start
        kind = "" if isinstance(failure, CheckpointError) else f"{type(failure).__name__}: "
        error = f"rank {worker.rank}: {kind}{failure}"
    gathered: list[Any] = [None] * worker.world_size
    dist.all_gather_object(gathered, (records, error), group=runner.group)
    errors = [e for _, e in gathered if e]
    if errors:
        raise CheckpointError(f"saving step {runner.global_step} failed ({'; '.join(errors)}); "
                              f"the previous checkpoint is intact ({directory} not completed)")
    outcome = ""
    if worker.rank == 0:
        try:
            files = {path: record for rank_files, _ in gathered for path, record in
                     rank_files.items()}
            write_manifest(directory, Manifest(runner.global_step, files,
                                               _meta(runner, files, extra is not None)))
        except Exception as failure:
            outcome = f"rank 0: {type(failure).__name__}: {failure}"
        if keep is not None and not outcome:
            try:
                prune(root, keep)
            except OSError as failure:  # the new checkpoint is complete: only tidying failed
                log.warning("parallax: could not delete old checkpoints under %s: %s", root,
                            failure)
    # Complete (or failed) on every rank's return.
    outcome = agree(outcome, rank=worker.rank, group=runner.group)
    if outcome:
        raise CheckpointError(f"saving step {runner.global_step} failed ({outcome}); "
                              f"the previous checkpoint is intact ({directory} not completed)")
    return directory


def _save_rank_files(runner: Run, directory: Path, extra: Any) -> dict[str, FileRecord]:
    worker = runner.worker
    records = {}
    for name, table in runner.layout.all_tables().items():
        held = table.held
        if held is not None and held.shard is not None:
            server = worker.server_ranks.index(worker.rank)
            rows, scalars = _split_state(runner.shard_optimizer.table_state(held), held.shard)
            path = f"tables/{name}/server-{server}.pt"
            records[path] = save_object(directory / path, {
                "ids": held.partitioning.rows_of_server(server),
                "values": held.shard.detach(), "state": rows, "scalars": scalars})
        elif table.replica is not None and worker.rank == 0:
            owner = optimizer_of(runner.optimizers, table.replica)
            state = dict(owner.state.get(table.replica, {})) if owner is not None else {}
            rows, scalars = _split_state(state, table.replica)
            path = f"tables/{name}/replica.pt"
            records[path] = save_object(directory / path, {
                "ids": torch.arange(table.num_rows), "values": table.replica.detach(),
                "state": rows, "scalars": scalars})
    # whole tensors of split layers (parallax.parallelism; collective in each model group)
    plain = runner.parallelism
    dense_model = plain.plain_model_state(runner.model.state_dict())
    optimizers = [plain.plain_optimizer_state(opt, local_state_dict(opt))
                  for opt in runner.optimizers]
    if worker.rank == 0:
        in_tables = _table_keys(runner)
        model = {k: v for k, v in dense_model.items() if k not in in_tables}
        records["dense.pt"] = save_object(directory / "dense.pt", {
            "model": model, "optimizers": optimizers})
        if extra is not None:
            records["extra.pt"] = save_object(directory / "extra.pt", extra)
    path = f"rng/rank-{worker.rank}.pt"
    records[path] = save_object(directory / path, _rng_state())
    return records


def _meta(runner: Run, files: dict[str, FileRecord], has_extra: bool) -> dict[str, Any]:
    from parallax.loader import records

    loaders = records(runner.training_run)
    tables = {}
    for name, table in runner.layout.all_tables().items():
        placement = runner.layout.placement(name)
        tables[name] = {
            "files": sorted(p for p in files if p.startswith(f"tables/{name}/")),
            "num_rows": table.num_rows, "row_shape": list(table.row_shape),
            "dtype": _dtype_name(table.dtype), "sync": placement.sync,
            "partitions": placement.partitions}
    return {
        "format": FORMAT, "step": runner.global_step,
        "parameters": {n: {"shape": list(p.shape), "dtype": _dtype_name(p.dtype)}
                       for n, p in runner.model.named_parameters()},
        "aliases": _aliases(runner.model),
        "tables": tables, "dense_file": "dense.pt",
        "extra_file": "extra.pt" if has_extra else None,
        "rng_files": {str(r): f"rng/rank-{r}.pt" for r in range(runner.worker.world_size)},
        "config": runner.config.to_dict(),
        "cluster": {"machines": len(runner.worker.server_ranks),
                    "world_size": runner.worker.world_size},
        "data": [loader["position"] for loader in loaders],
        "data_loaders": [loader["loader"] for loader in loaders],
        "torch": torch.__version__,
    }


# ---- loading ---------------------------------------------------------------------------------


def load(runner: Run, path: str | os.PathLike[str]) -> Any:
    """Restore ``runner`` (and the `parallax.shard` loaders) from the checkpoint at ``path``
    or the newest complete one under it; returns the saved ``extra`` (collective).

    Every rank first reads and checks all it needs (checksums, the model's parameters, every
    row it will hold); only when every rank succeeded does anything change, so a bad
    checkpoint raises on every rank and leaves the runner as it was."""
    worker = runner.worker
    found = agree(str(find_checkpoint(path) or "") if worker.rank == 0 else None,
                  rank=worker.rank, group=runner.group)
    if not found:
        raise CheckpointError(f"no complete checkpoint at or under {path}")
    directory = Path(found)
    restore, error = None, None
    try:
        restore = _prepare(runner, directory)
    except Exception as failure:  # reported on every rank below
        error = f"rank {worker.rank}: {failure}"
    errors: list[Any] = [None] * worker.world_size
    dist.all_gather_object(errors, error, group=runner.group)
    failed = [e for e in errors if e]
    if failed:
        raise CheckpointError(f"cannot load {directory} ({'; '.join(failed)}); nothing was "
                              f"loaded")
    assert restore is not None
    return restore.apply(runner)


class _Restore:
    """What `load` applies once every rank has read and checked its part."""

    def __init__(self, directory: Path, manifest: Manifest) -> None:
        self.directory, self.manifest = directory, manifest
        self.dense: dict[str, Any] = {}
        self.full: dict[str, tuple[Tensor, dict[str, Any]]] = {}   # whole on every worker
        self.shards: dict[str, tuple[Tensor, dict[str, Any]]] = {}  # this server's rows
        self.from_model: list[str] = []  # dense in the checkpoint, server-held here
        self.rng: dict[str, Any] | None = None
        self.extra: Any = None

    def apply(self, runner: Run) -> Any:
        meta = self.manifest.meta
        # first: a loader that reads other data than the checkpoint's is refused before
        # anything else changes
        _resume_loaders(meta, self.directory, runner)
        params = dict(runner.model.named_parameters())
        # A parameter dense in the checkpoint and server-held here gets its values back for a
        # moment, so that the optimizers load its state beside it (they move state to the
        # parameter's device) and its rows can be cut from both (engine.handles).
        for name in self.from_model:
            if is_released(params[name]):
                restore(params[name], self.dense["model"][name])
        rest = runner.parallelism.load_plain_model_state(self.dense["model"])
        runner.model.load_state_dict(rest, strict=False)
        for optimizer, state in zip(runner.optimizers, self.dense["optimizers"], strict=True):
            local_load_state_dict(optimizer, state)
            runner.parallelism.distribute_optimizer_state(optimizer)
        tables = runner.layout.all_tables()
        for name in self.from_model:  # now that the dense state is in the model
            table = tables[name]
            held = table.held
            if held is not None:
                if held.shard is not None:
                    piece = _piece_from_model(runner, table, self.dense["model"][name])
                    self.shards[name] = _assemble_shard(held, [piece], self.directory,
                                                        runner.worker.rank)
            else:
                piece = _piece_from_model(runner, table, self.dense["model"][name])
                self.full[name] = _assemble_full(_replica(table), table.num_rows,
                                                 table.row_shape, [piece])
        for name in self.from_model:
            if tables[name].on_servers:
                release(params[name], name=name, device=runner.worker.device,
                        rank=runner.worker.rank)
        for name, (full, state) in self.full.items():
            param = params[name]
            with torch.no_grad():
                param.copy_(full.view_as(param))
            owner = optimizer_of(runner.optimizers, param)
            if owner is not None and state:
                owner.state[param] = {k: v.view_as(param) if is_per_row(v, full) else v
                                      for k, v in state.items()}
        for name, (values, state) in self.shards.items():
            table = tables[name]
            held = table.held
            if held is None:
                raise CheckpointError(f"'{name}' is no longer held by the servers")
            held.settle()  # deferred steps belong to the values being replaced
            with torch.no_grad():  # in place: the partitions view the shard's storage
                held.server_shard().copy_(values)
            runner.shard_optimizer.set_table_state(held, state)
            table.zero_grad()
        if self.rng is not None:
            _set_rng_state(self.rng)
        elif runner.worker.rank == 0:
            log.warning("parallax: %s was saved by %d workers, resumed on %d: random "
                        "generators start afresh (the data order is restored)", self.directory,
                        meta["cluster"]["world_size"], runner.worker.world_size)
        runner.global_step = self.manifest.step
        return self.extra


def _prepare(runner: Run, directory: Path) -> _Restore:
    """Read and check everything this rank needs from ``directory``, changing nothing."""
    manifest = read_manifest(directory)
    meta = manifest.meta
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{directory}: not a parallax checkpoint")
    _check_compatible(directory, meta, runner)

    def read(relative: str, **kwargs: Any) -> Any:
        if relative not in manifest.files:
            raise CheckpointError(f"{directory}: {relative} is not listed in the manifest")
        return load_object(directory / relative, manifest.files[relative], **kwargs)

    restore = _Restore(directory, manifest)
    restore.dense = read(meta["dense_file"])
    expected = set(runner.model.state_dict())
    given = set(restore.dense["model"])
    missing = expected - given - _table_keys(runner, meta)
    if missing or given - expected:
        raise CheckpointError(f"{directory}: dense state does not fit the model (missing "
                              f"{sorted(missing)}, unexpected {sorted(given - expected)})")
    if len(restore.dense["optimizers"]) != len(runner.optimizers):
        raise CheckpointError(f"{directory} holds {len(restore.dense['optimizers'])} "
                              f"optimizer(s), this program has {len(runner.optimizers)}")
    tables = runner.layout.all_tables()
    params = dict(runner.model.named_parameters())
    for name, info in meta["tables"].items():  # server-held there, dense here (ps -> hybrid)
        if name not in tables:
            restore.full[name] = _assemble_full(params[name], info["num_rows"],
                                                tuple(info["row_shape"]),
                                                [read(f) for f in info["files"]])
    for name, table in tables.items():
        if name not in meta["tables"]:
            restore.from_model.append(name)
        elif (held := table.held) is not None:
            if held.shard is not None:
                pieces = _in_rows_of(held, meta["tables"][name],
                                     [read(f) for f in meta["tables"][name]["files"]])
                restore.shards[name] = _assemble_shard(held, pieces, directory,
                                                       runner.worker.rank)
        else:
            info = meta["tables"][name]
            restore.full[name] = _assemble_full(_replica(table), info["num_rows"],
                                                tuple(info["row_shape"]),
                                                [read(f) for f in info["files"]])
    if meta["cluster"]["world_size"] == runner.worker.world_size:
        restore.rng = read(meta["rng_files"][str(runner.worker.rank)])
    if meta.get("extra_file"):
        restore.extra = read(meta["extra_file"], weights_only=False)
    return restore


def _check_compatible(directory: Path, meta: dict[str, Any], runner: Run) -> None:
    saved = meta["parameters"]
    here = {n: {"shape": list(p.shape), "dtype": _dtype_name(p.dtype)}
            for n, p in runner.model.named_parameters()}
    problems = [f"'{n}' is not in the model" for n in sorted(set(saved) - set(here))]
    problems += [f"'{n}' is not in the checkpoint" for n in sorted(set(here) - set(saved))]
    problems += [f"'{n}' has shape {here[n]['shape']} {here[n]['dtype']} here, "
                 f"{saved[n]['shape']} {saved[n]['dtype']} in the checkpoint"
                 for n in sorted(set(saved) & set(here)) if saved[n] != here[n]]
    if problems:
        raise CheckpointError(f"{directory} does not belong to this model: "
                              + "; ".join(problems))


def _piece_from_model(runner: Run, table: Table, values: Tensor) -> dict[str, Any]:
    """A parameter the checkpoint holds with the dense state (replicated there, server-held
    here, e.g. a dense parameter resumed under ``ps``): its saved ``values`` and the state
    already loaded into the user's optimizer, as one piece. (The model's own copy of a
    server-held parameter holds no values: parallax.engine.tables.handles.)"""
    param = dict(runner.model.named_parameters())[table.name]
    owner = optimizer_of(runner.optimizers, param)
    rows, scalars = _split_state(dict(owner.state.get(param, {})) if owner else {}, param)
    shape = (table.num_rows, *table.row_shape)
    return {"ids": torch.arange(table.num_rows), "values": values.detach().reshape(shape),
            "state": {key: value.reshape(shape) for key, value in rows.items()},
            "scalars": scalars}


def _in_rows_of(table: ShardedTable, info: dict[str, Any],
                pieces: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``pieces`` of a table saved as ``info`` says, as rows of ``table`` as it is held now:
    as they are where the rows are alike; else (a table held as column slices on one side,
    `parallax.engine.tables.columns`: its rows are slices of the program's rows) as one piece
    of all rows, assembled whole in the saved rows and viewed in the rows held now."""
    if (info["num_rows"], tuple(info["row_shape"])) == (table.num_rows, table.row_shape):
        return pieces
    like = torch.empty(0, dtype=table.dtype, device=table.device)
    full, state = _assemble_full(like, info["num_rows"], tuple(info["row_shape"]), pieces)
    shape = (table.num_rows, *table.row_shape)
    return [{"ids": torch.arange(table.num_rows), "values": full.reshape(shape),
             "state": {k: v.reshape(shape) for k, v in state.items() if is_per_row(v, full)},
             "scalars": {k: v for k, v in state.items() if not is_per_row(v, full)}}]


def _assemble_shard(table: ShardedTable, pieces: list[dict[str, Any]], directory: Path,
                    rank: int) -> tuple[Tensor, dict[str, Any]]:
    """This server's rows of ``table`` under its current partitioning, and their optimizer
    state, from pieces of any partitioning."""
    shard = table.server_shard()
    values = torch.empty_like(shard)
    rows: dict[str, Tensor] = {}
    filled = 0
    for piece in pieces:
        ids = piece["ids"].to(table.device)
        mine = table.partitioning.owner_rank(ids) == rank
        local = table.partitioning.local_row(ids[mine])
        values[local] = piece["values"].to(table.device, table.dtype).reshape(
            -1, *table.row_shape)[mine]
        for key, value in piece["state"].items():
            target = rows.setdefault(key, torch.zeros(shard.shape, dtype=value.dtype,
                                                      device=table.device))
            target[local] = value.to(table.device).reshape(-1, *table.row_shape)[mine]
        filled += int(mine.sum())
    if filled != shard.shape[0]:
        raise CheckpointError(f"{directory}: table '{table.name}' restores {filled} of the "
                              f"{shard.shape[0]} rows rank {rank} holds")
    return values, ({**pieces[0]["scalars"], **rows} if rows or pieces[0]["scalars"] else {})


def _replica(table: Table) -> torch.nn.Parameter:
    """The parameter a replicated table holds whole on every worker."""
    if table.replica is None:
        raise CheckpointError(f"'{table.name}' is neither server-held nor replicated")
    return table.replica


def _assemble_full(param: Tensor, num_rows: int, row_shape: tuple[int, ...],
                   pieces: list[dict[str, Any]]) -> tuple[Tensor, dict[str, Any]]:
    """A parameter every worker holds whole: all its rows and their optimizer state."""
    full = torch.empty(num_rows, *row_shape, dtype=param.dtype, device=param.device)
    rows: dict[str, Tensor] = {}
    for piece in pieces:
        ids = piece["ids"].to(param.device)
        full[ids] = piece["values"].to(param.device, param.dtype).reshape(-1, *row_shape)
        for key, value in piece["state"].items():
            rows.setdefault(key, torch.zeros_like(full, dtype=value.dtype))[ids] = value.to(
                param.device).reshape(-1, *row_shape)
    return full, ({**pieces[0]["scalars"], **rows} if rows or pieces[0]["scalars"] else {})


def _resume_loaders(meta: dict[str, Any], directory: Path, runner: Run) -> None:
    """The saved loader positions to the `parallax.shard` loaders of ``runner``'s run, in
    order (`parallax.loader.resume_loaders`: those the program made before the resume, then
    the ones it makes after it)."""
    from parallax.loader import resume_loaders

    positions = meta.get("data", [])
    described = meta.get("data_loaders") or [None] * len(positions)  # older checkpoints
    saved = [{"position": position, "loader": loader}
             for position, loader in zip(positions, described, strict=True)]
    run = runner.training_run
    try:
        resume_loaders(run, saved)
    except CheckpointError as error:
        raise CheckpointError(f"{directory}: {error}") from None


# ---- helpers --------------------------------------------------------------------------------
def _split_state(state: dict[str, Any], values: Tensor) -> tuple[dict[str, Tensor],
                                                                 dict[str, Any]]:
    rows = {k: v.detach() for k, v in state.items() if is_per_row(v, values)}
    return rows, {k: v for k, v in state.items() if k not in rows}


def _aliases(model: torch.nn.Module) -> dict[str, str]:
    canonical = {id(p): n for n, p in model.named_parameters()}
    return {n: canonical[id(p)] for n, p in model.named_parameters(remove_duplicate=False)
            if canonical[id(p)] != n}


def _table_keys(runner: Run, meta: dict[str, Any] | None = None) -> set[str]:
    """State-dict keys whose values live in table files (tables and their aliases)."""
    names = set(runner.layout.all_tables())
    if meta is not None:
        names |= set(meta["tables"])
    aliases = _aliases(runner.model)
    return names | {alias for alias, name in aliases.items() if name in names}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _rng_state() -> dict[str, Any]:
    kind, keys, position, has_gauss, gauss = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": [kind, torch.from_numpy(np.asarray(keys).copy()), position, has_gauss,
                       gauss]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, position, has_gauss, gauss_value = state["numpy"]
    np.random.set_state((kind, keys.numpy(), position, has_gauss, gauss_value))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
