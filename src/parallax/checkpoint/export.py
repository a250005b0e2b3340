"""Turn a sharded checkpoint into one plain ``state_dict`` for inference or other tools.

A checkpoint written during training is spread over files: the dense part of the model in
one file, every sparse table in row shards keyed by row id (one shard per server and
partition). Serving a model, fine-tuning it elsewhere or handing it to someone without
parallax needs the ordinary single-file form, ``model.load_state_dict(torch.load(f))``.
Exporting re-assembles the tables row by row, checks that their shards cover every row once,
gives tied parameters back their other names and leaves the optimizer state behind.

Every file read is checked against the manifest's size and SHA-256 first (`load_object`), so
an export never silently carries a corrupt shard into a model.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from parallax.checkpoint.files import (
    MANIFEST_NAME,
    CheckpointError,
    Manifest,
    find_checkpoint,
    load_object,
    read_manifest,
    save_object,
)
from parallax.checkpoint.streamed import StreamedFile
from parallax.engine.tables.server_table import ShardedTable

__all__ = [
    "CHECKPOINT_FORMAT",
    "ExportedCheckpoint",
    "export",
    "ExportedFile",
    "export_running",
    "export_state_dict",
    "read_checkpoint",
    "resolve_checkpoint",
    "save_state_dict",
    "stream_export",
]

#: ``meta["format"]`` of the runner's checkpoints; anything else is not ours to export.
CHECKPOINT_FORMAT = "parallax-checkpoint"


@dataclass(frozen=True)
class ExportedCheckpoint:
    """A checkpoint assembled into one state_dict, with where and which step it came from."""

    directory: Path
    step: int
    state_dict: dict[str, torch.Tensor]


def resolve_checkpoint(checkpoint: str | os.PathLike[str]) -> Path:
    """The step directory ``checkpoint`` names: itself when it is one, else the newest
    complete one below it (a checkpoint root), so users can point at the root they trained
    with and get the latest state."""
    path = Path(checkpoint)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    # A step directory, complete or not (read_manifest says which), or the newest under a root.
    found = find_checkpoint(path, by_name=True)
    if found is None:
        raise CheckpointError(
            f"{path}: no complete checkpoint here (no step-NNNNNNNNN directory with a "
            f"readable {MANIFEST_NAME})"
        )
    return found


def read_checkpoint(checkpoint: str | os.PathLike[str]) -> ExportedCheckpoint:
    """Assemble the checkpoint ``checkpoint`` (step directory or root) into one state_dict.

    Raises CheckpointError naming the file or table at fault when a file is missing or
    corrupt, the manifest's meta is malformed, or a table's shards miss or repeat rows.
    """
    directory, manifest, meta, state = _read_dense(checkpoint)
    for name, table in meta.tables.items():
        shape = meta.shape(name)
        values = torch.empty(shape, dtype=_dtype(directory, name, table))
        # (a table held as column slices: the values' memory as rows of slices)
        rows_of = values.view(table["num_rows"], *table["row_shape"])
        for ids, rows in _table_shards(directory, manifest, name, table, shape):
            rows_of[ids] = rows.reshape(len(ids), *table["row_shape"])
        state[name] = values
    _add_aliases(directory, meta, state)
    return ExportedCheckpoint(directory=directory, step=manifest.step, state_dict=state)


def _read_dense(checkpoint: str | os.PathLike[str],
                ) -> tuple[Path, Manifest, _Meta, dict[str, torch.Tensor]]:
    """The checkpoint's directory, manifest, meta and dense state (checked: every parameter
    is a table or in the dense file, and not both)."""
    directory = resolve_checkpoint(checkpoint)
    manifest = read_manifest(directory)
    meta = _Meta.parse(directory, manifest)
    state: dict[str, torch.Tensor] = {}
    dense = _load(directory, manifest, meta.dense_file)
    model = dense.get("model") if isinstance(dense, dict) else None
    if not isinstance(model, dict):
        raise CheckpointError(
            f"{directory / meta.dense_file}: expected a dict with a 'model' state_dict, "
            f"got {type(dense).__name__}" + (f" with keys {sorted(dense)}"
                                             if isinstance(dense, dict) else "")
        )
    for key, value in model.items():
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(
                f"{directory / meta.dense_file}: model[{key!r}] is a {type(value).__name__}, "
                "not a tensor"
            )
        state[key] = value.detach().cpu()
    for name in meta.tables:
        if name in state:
            raise CheckpointError(
                f"{directory / MANIFEST_NAME}: table {name!r} is also in "
                f"{meta.dense_file}'s model state"
            )
    missing = [name for name in meta.parameters if name not in state
               and name not in meta.tables and meta.aliases.get(name) is None]
    if missing:
        raise CheckpointError(
            f"{directory / MANIFEST_NAME}: parameter(s) {', '.join(map(repr, missing))} are "
            f"neither tables nor in {meta.dense_file}"
        )
    return directory, manifest, meta, state


def export_state_dict(checkpoint: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The model of checkpoint ``checkpoint`` as a plain CPU state_dict (tied parameters
    under all their names, sharing one tensor); see `read_checkpoint`."""
    return read_checkpoint(checkpoint).state_dict


def save_state_dict(state_dict: Mapping[str, torch.Tensor], out: str | os.PathLike[str]) -> Path:
    """``torch.save`` ``state_dict`` to ``out`` atomically: a crash mid-write leaves either
    the previous file or none, never a truncated one that loads as garbage later."""
    save_object(Path(out), dict(state_dict))
    return Path(out)


def export(checkpoint: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Write checkpoint ``checkpoint``'s model to ``out`` as a single-file state_dict,
    streamed (`stream_export`)."""
    return stream_export(checkpoint, out).path


@dataclass(frozen=True)
class ExportedFile:
    """Where `stream_export` wrote, which step, how many state_dict entries."""

    path: Path
    step: int
    tensors: int


def stream_export(checkpoint: str | os.PathLike[str],
                  out: str | os.PathLike[str]) -> ExportedFile:
    """Write checkpoint ``checkpoint``'s model to ``out`` as a single-file state_dict,
    streamed: each table goes to the file shard file by shard file (`StreamedFile`), so a
    table larger than this machine's memory exports; one shard file is read (memory-mapped)
    at a time. ``torch.load(out, mmap=True)`` reads the result the same way."""
    directory, manifest, meta, state = _read_dense(checkpoint)
    tables = {name: (meta.shape(name), _dtype(directory, name, table))
              for name, table in meta.tables.items()}
    table_aliases = {alias: name for alias, name in meta.aliases.items() if name in tables}
    _add_aliases(directory, meta, state, skip=set(table_aliases))
    with StreamedFile(out, state, tables, table_aliases) as streamed:
        for name, table in meta.tables.items():
            for ids, rows in _table_shards(directory, manifest, name, table, meta.shape(name)):
                streamed.write_rows(name, ids, rows)
                del ids, rows  # one shard file mapped at a time
    return ExportedFile(Path(out), manifest.step, len(state) + len(tables) + len(table_aliases))


_CHUNK_BYTES = 4 << 20  # rows pulled per exchange by `export_running` (a few copies in flight)


def export_running(out: str | os.PathLike[str], state: dict[str, torch.Tensor],
                   tables: Mapping[str, ShardedTable], names: Mapping[str, Sequence[str]], *,
                   rank: int) -> Path | None:
    """Write a running model's plain state_dict to ``out`` on rank 0 (collective): ``state``
    is the model's own (server-held entries are storage-less handles); each table of
    ``tables`` is pulled from its servers ``_CHUNK_BYTES`` of rows at a time and written to
    the file (`StreamedFile`) under every name in ``names[table]``. No process holds a whole
    table in memory. Returns ``out`` on rank 0, None elsewhere."""
    streamed = None
    if rank == 0:
        held = {alias for name in tables for alias in names[name]}
        streamed = StreamedFile(
            out, {k: v for k, v in state.items() if k not in held},
            {name: (state[name].shape, table.dtype) for name, table in tables.items()},
            {alias: name for name in tables for alias in names[name] if alias != name})
    with streamed if streamed is not None else contextlib.nullcontext():
        for name, table in tables.items():
            row_bytes = table.dtype.itemsize * math.prod(table.row_shape)
            step = max(1, _CHUNK_BYTES // max(1, row_bytes))
            for start in range(0, table.num_rows, step):
                stop = min(table.num_rows, start + step)
                ids = (torch.arange(start, stop) if streamed is not None
                       else torch.empty(0, dtype=torch.long))
                rows = table.read_rows(ids.to(table.device))  # collective
                if streamed is not None:
                    streamed.write_rows(name, ids, rows)
    return Path(out) if streamed is not None else None


@dataclass(frozen=True)
class _Meta:
    """The parts of a manifest's meta that export needs, checked for shape and type."""

    parameters: dict[str, dict[str, Any]]
    aliases: dict[str, str]
    tables: dict[str, dict[str, Any]]
    dense_file: str
    where: Path

    @classmethod
    def parse(cls, directory: Path, manifest: Manifest) -> _Meta:
        where = directory / MANIFEST_NAME
        meta = manifest.meta
        if meta.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointError(
                f"{where}: meta.format is {meta.get('format')!r}, expected {CHECKPOINT_FORMAT!r}"
            )
        fields: dict[str, Any] = {}
        for key, kind in (("parameters", dict), ("aliases", dict), ("tables", dict),
                          ("dense_file", str)):
            value = meta.get(key)
            if not isinstance(value, kind):
                raise CheckpointError(
                    f"{where}: meta.{key} must be a {kind.__name__}, got {value!r:.80}"
                )
            fields[key] = value
        for name, entry in fields["tables"].items():
            if name not in fields["parameters"]:
                raise CheckpointError(f"{where}: table {name!r} is not in meta.parameters")
            for key in ("files", "num_rows", "row_shape", "dtype"):
                if key not in entry:
                    raise CheckpointError(f"{where}: table {name!r} has no {key!r}")
        return cls(**fields, where=where)

    def shape(self, name: str) -> list[int]:
        """The full shape of parameter ``name``."""
        shape = self.parameters[name].get("shape")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise CheckpointError(
                f"{self.where}: meta.parameters[{name!r}].shape must be a list of ints >= 0, "
                f"got {shape!r}"
            )
        return shape


def _load(directory: Path, manifest: Manifest, relpath: str) -> Any:
    """Load one listed file after checking it against the manifest."""
    record = manifest.files.get(relpath)
    if record is None:
        raise CheckpointError(
            f"{directory / MANIFEST_NAME}: meta names {relpath!r}, which the manifest's file "
            "list does not record"
        )
    return load_object(directory / relpath, record)


def _dtype(directory: Path, name: str, table: Mapping[str, Any]) -> torch.dtype:
    dtype = getattr(torch, str(table["dtype"]), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"{directory / MANIFEST_NAME}: table {name!r} has unknown "
                              f"dtype {table['dtype']!r}")
    return dtype


def _table_shape(directory: Path, name: str, table: Mapping[str, Any],
                 shape: list[int]) -> tuple[int, ...]:
    """``(rows, *row shape)`` of table ``name``, checked against its parameter's shape: its
    rows, or, for a table held as column slices (`parallax.engine.tables.columns`), its rows'
    slices (a whole number of them per row)."""
    num_rows, row_shape = table["num_rows"], table["row_shape"]
    if (not isinstance(num_rows, int) or num_rows < 0 or not isinstance(row_shape, list)
            or not shape or num_rows % max(shape[0], 1) or math.prod(shape) != num_rows
            * math.prod(row_shape)):
        raise CheckpointError(
            f"{directory / MANIFEST_NAME}: table {name!r} of {num_rows!r} rows of shape "
            f"{row_shape!r} does not fit its parameter's shape {shape}"
        )
    return (num_rows, *row_shape)


def _table_shards(directory: Path, manifest: Manifest, name: str, table: Mapping[str, Any],
                  shape: list[int]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Table ``name``'s ``(ids, rows)``, one shard file at a time, rows in the parameter's
    row shape (the slices' shape, flat, for a table held as column slices); raises after the
    last one if the shards miss or repeat rows."""
    num_rows, *row_shape = _table_shape(directory, name, table, shape)
    dtype = _dtype(directory, name, table)
    counts = torch.zeros(num_rows, dtype=torch.long)
    for relpath in table["files"]:
        ids, rows = _table_shard(directory, manifest, relpath, name, num_rows, row_shape, dtype)
        counts += torch.bincount(ids, minlength=num_rows)
        yield ids, rows.reshape(len(ids), *(shape[1:] if num_rows == shape[0] else (-1,)))
        del ids, rows  # the file's mapping goes with the consumer's last reference
    missing, repeated = int((counts == 0).sum()), int((counts > 1).sum())
    if missing or repeated:
        first = int(torch.nonzero(counts != 1)[0])
        raise CheckpointError(
            f"{directory}: table {name!r}: its {len(table['files'])} file(s) leave {missing} of "
            f"{num_rows} rows missing and {repeated} repeated (first bad row {first})"
        )


def _table_shard(directory: Path, manifest: Manifest, relpath: str, name: str,
                 num_rows: int, row_shape: list[int],
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One shard's (ids, rows), checked against the table's row count, row shape and dtype."""
    path = directory / relpath
    shard = _load(directory, manifest, relpath)
    ids = shard.get("ids") if isinstance(shard, dict) else None
    rows = shard.get("values") if isinstance(shard, dict) else None
    if not isinstance(ids, torch.Tensor) or not isinstance(rows, torch.Tensor):
        raise CheckpointError(f"{path}: table {name!r} shard must be a dict with tensors "
                              "'ids' and 'values'")
    if ids.dim() != 1 or ids.dtype != torch.long:
        raise CheckpointError(f"{path}: table {name!r} ids must be a 1-D int64 tensor, got "
                              f"{ids.dtype} of shape {list(ids.shape)}")
    if list(rows.shape) != [len(ids), *row_shape] or rows.dtype != dtype:
        raise CheckpointError(
            f"{path}: table {name!r} values are {rows.dtype} of shape {list(rows.shape)}, "
            f"expected {dtype} of shape {[len(ids), *row_shape]}"
        )
    ids = ids.cpu()
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= num_rows):
        raise CheckpointError(f"{path}: table {name!r} has row ids outside 0..{num_rows - 1}")
    return ids, rows.detach().cpu()


def _add_aliases(directory: Path, meta: _Meta, state: dict[str, torch.Tensor], *,
                 skip: set[str] | None = None) -> None:
    """Give tied parameters their other names, sharing the canonical tensor as in the model
    (not those in ``skip``)."""
    for alias, canonical in meta.aliases.items():
        if skip and alias in skip:
            if alias in state:
                raise CheckpointError(
                    f"{directory / MANIFEST_NAME}: alias {alias!r} of table {canonical!r} is "
                    f"also in {meta.dense_file}'s model state")
            continue
        if canonical not in state:
            raise CheckpointError(
                f"{directory / MANIFEST_NAME}: alias {alias!r} names {canonical!r}, which is "
                "neither a table nor in the dense state"
            )
        if alias in state and canonical in meta.tables:
            raise CheckpointError(
                f"{directory / MANIFEST_NAME}: alias {alias!r} of table {canonical!r} is also "
                f"in {meta.dense_file}'s model state"
            )
        state.setdefault(alias, state[canonical])
