"""A ``torch.save`` file written piece by piece: tables larger than memory go to disk in chunks.

`StreamedFile` first saves the state dict with ``torch.serialization.skip_data()``: the file
gets its final layout (the pickled structure, one record per storage) but the large
tensors' bytes are left as holes. Loading that file on the ``meta`` device gives every
storage's byte offset in it (``_checkpoint_offset``, as torch's own offset-aware loaders use
it); the small tensors' bytes and then each table's rows are written at their offsets with
``os.pwrite`` (contiguous rows) or through a shared mapping of the table's bytes that is
dropped from the process after every batch of scattered rows (``MADV_DONTNEED``: the pages
stay in the page cache, dirty, and reach the disk). No process memory ever holds a whole
table; the result is an ordinary file for ``torch.load`` (``mmap=True`` reads it the same
way). It is written beside its destination under a temporary name and renamed when complete,
as `parallax.checkpoint.files.write_atomic` does.
"""

from __future__ import annotations

import math
import mmap
import os
import secrets
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import Tensor

from parallax.checkpoint.files import TMP_PREFIX, FileRecord, _fsync_dir, _record_of
from parallax.errors import CheckpointError, InternalError

__all__ = ["StreamedFile"]

_SCATTER_ROWS = 1 << 14  # scattered rows written per mapped batch (then the pages are dropped)


class StreamedFile:
    """``with StreamedFile(out, state, tables, aliases) as f: f.write_rows(...)``: ``state``'s
    tensors are written as they are; ``tables`` (name -> (shape, dtype)) are filled with
    `write_rows`; ``aliases`` (name -> table name) share a table's tensor, as tied
    parameters do. On a clean exit the file is renamed to ``out``; on an error it is removed."""

    def __init__(self, out: str | os.PathLike[str], state: Mapping[str, Tensor],
                 tables: Mapping[str, tuple[Sequence[int], torch.dtype]],
                 aliases: Mapping[str, str] | None = None):
        self.out = Path(out)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = self.out.with_name(
            f"{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-{self.out.name[:200]}")
        self.tables = {name: (tuple(shape), dtype) for name, (shape, dtype) in tables.items()}
        self.written = {name: 0 for name in self.tables}  # elements: every row came
        try:
            self._layout(dict(state), dict(aliases or {}))
            self._fd = os.open(self.tmp, os.O_RDWR)
        except BaseException:
            self.tmp.unlink(missing_ok=True)
            raise
        self.record: FileRecord | None = None

    def _layout(self, state: dict[str, Tensor], aliases: dict[str, str]) -> None:
        """Save the structure with holes for the bytes; find where every storage goes."""
        with tempfile.TemporaryDirectory(dir=self.out.parent, prefix=".parallax-") as scratch:
            # stand-ins with storage but no memory: shared mappings of sparse scratch files,
            # never touched (skip_data does not read them)
            for index, (name, (shape, dtype)) in enumerate(self.tables.items()):
                state[name] = torch.from_file(str(Path(scratch, f"{index}")), shared=True,
                                              size=math.prod(shape), dtype=dtype).view(shape)
            for alias, name in aliases.items():
                state[alias] = state[name]
            with torch.serialization.skip_data():
                torch.save(state, self.tmp)
        located = torch.load(self.tmp, map_location="meta", weights_only=True)
        self.offsets = {name: _file_offset(name, value)
                        + int(value.storage_offset()) * value.element_size()
                        for name, value in located.items() if isinstance(value, Tensor)}
        self._small = {name: value for name, value in state.items()
                       if isinstance(value, Tensor) and name not in self.tables
                       and aliases.get(name) is None}

    def __enter__(self) -> StreamedFile:
        done = set()
        for name, value in self._small.items():
            # torch.save wrote each storage whole: so are its bytes here (once per storage)
            start = self.offsets[name] - int(value.storage_offset()) * value.element_size()
            if start not in done:
                done.add(start)
                storage = torch.empty(0, dtype=torch.uint8).set_(value.untyped_storage())
                os.pwrite(self._fd, storage.cpu().numpy().data, start)
        return self

    def write_rows(self, name: str, ids: Tensor, rows: Tensor) -> None:
        """Rows ``ids`` (global, distinct) of table ``name`` take the values ``rows``: rows
        of the table's shape, or of any width that divides its rows, numbered as the table's
        memory read in rows of that width (a table held as column slices:
        `parallax.engine.tables.columns`)."""
        shape, dtype = self.tables[name]
        rows = rows.detach().to("cpu", dtype).contiguous().view(len(ids), -1)
        width = int(rows.shape[1])
        row_bytes = width * rows.element_size()
        count = math.prod(shape) // max(width, 1)  # the table's rows of this width
        ids = ids.cpu()
        base = self.offsets[name]
        self.written[name] += rows.numel()
        if len(ids) == 0:
            return
        first = int(ids[0])
        if torch.equal(ids, torch.arange(first, first + len(ids))):
            os.pwrite(self._fd, rows.view(torch.uint8).numpy().data, base + first * row_bytes)
            return
        start = base // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
        length = base - start + count * row_bytes
        with mmap.mmap(self._fd, length, offset=start) as region:
            for at in range(0, len(ids), _SCATTER_ROWS):
                view = torch.frombuffer(region, dtype=dtype, count=count * width,
                                        offset=base - start).view(count, width)
                view[ids[at:at + _SCATTER_ROWS]] = rows[at:at + _SCATTER_ROWS]
                del view  # releases the buffer export, so the region can close
                region.madvise(mmap.MADV_DONTNEED)  # out of this process; dirty in the cache

    def __exit__(self, kind: object, error: object, trace: object) -> None:
        try:
            if kind is None:
                short = {n: (self.written[n], math.prod(shape))
                         for n, (shape, _) in self.tables.items()
                         if self.written[n] != math.prod(shape)}
                if short:
                    raise InternalError(f"parallax internal error: elements written / "
                                        f"elements per table {short} while streaming "
                                        f"{self.out}")
                os.fsync(self._fd)
        finally:
            os.close(self._fd)
        if kind is not None:
            self.tmp.unlink(missing_ok=True)
            return
        self.record = _record_of(self.tmp)
        os.replace(self.tmp, self.out)
        _fsync_dir(self.out.parent)


def _file_offset(name: str, value: Tensor) -> int:
    """Where ``value``'s storage starts in the file ``torch.load`` mapped it from."""
    offset = value.untyped_storage()._checkpoint_offset
    if offset is None:
        raise CheckpointError(f"torch.load gave no file offset for '{name}'s storage; this "
                              f"torch does not record them (torch >= 2.13 does)")
    return int(offset)
