"""The file layer of sharded checkpoints: atomic writes, checksums, manifests, retention.

A checkpoint of step ``s`` is a directory ``root/step-<s:09d>``. Every server writes its own
shard files into it, then rank 0 writes ``manifest.json`` LAST; the manifest lists every file
with its size and SHA-256 and carries a checksum of its own body. So:

* a save that crashed part-way leaves a step directory without a manifest, which readers skip,
  and the previous checkpoint stays the newest complete one;
* every file is written to a temporary name (prefix ``.tmp-``) in its final directory, fsynced,
  renamed over its final name and the directory fsynced: a file under its final name is always
  whole, and a leftover temporary file is never mistaken for a real one;
* corruption or truncation of any file, the manifest included, is detected by size and checksum.

No ``torch.distributed`` here: gathering the servers' `FileRecord` s onto rank 0 is the
runner's business.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

import torch

from parallax.checks import is_int
from parallax.errors import ArgumentError, CheckpointError

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "TMP_PREFIX",
    "CheckpointError",
    "FileRecord",
    "Manifest",
    "find_checkpoint",
    "is_temp_name",
    "load_object",
    "newest_complete",
    "prune",
    "read_manifest",
    "save_object",
    "step_dir",
    "verify",
    "write_atomic",
    "write_manifest",
]

logger = logging.getLogger("parallax")

#: Version of the manifest layout this module writes and reads.
FORMAT_VERSION = 1
#: Name of the manifest inside a step directory; its presence marks the checkpoint complete.
MANIFEST_NAME = "manifest.json"
#: Prefix of temporary files (``.tmp-<pid>-<random>-<final name>``); never a real file's name.
TMP_PREFIX = ".tmp-"
#: Prefix a step directory is renamed to before deletion, so a half-deleted one never looks
#: like a checkpoint.
_TRASH_PREFIX = ".trash-"
_STEP_RE = re.compile(r"step-(\d{9,})")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_CHUNK = 1 << 20


@dataclass(frozen=True)
class FileRecord:
    """What a file must contain: its SHA-256 (lowercase hex) and its size in bytes."""

    sha256: str
    size: int


@dataclass
class Manifest:
    """The list of a checkpoint's files, written last so that its presence means complete.

    Attributes:
        step: the training step the checkpoint holds.
        files: every file of the checkpoint, keyed by its POSIX path relative to the step
            directory (e.g. ``"server-0/partition-3.pt"``).
        meta: JSON-able facts needed to resume (config, cluster shape, partition counts, data
            position, ...). Read back as JSON gives it: tuples come back as lists.
        format_version: layout version; readers refuse versions they do not know.
    """

    step: int
    files: dict[str, FileRecord] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION


def step_dir(root: str | os.PathLike[str], step: int) -> Path:
    """Directory of step ``step``'s checkpoint; zero-padded so names sort like steps."""
    if not is_int(step, at_least=0):
        raise ArgumentError(f"checkpoint step must be an int >= 0, got {step!r}")
    return Path(root) / f"step-{step:09d}"


def is_temp_name(name: str) -> bool:
    """Whether ``name`` is a temporary file of `write_atomic` (complete or not, never real)."""
    return name.startswith(TMP_PREFIX)


def write_atomic(path: Path, data: bytes | bytearray | memoryview) -> FileRecord:
    """Write ``data`` to ``path`` so that ``path`` holds either the old content or all of it.

    The bytes go to a temporary file in the same directory (a rename is only atomic within one
    file system), are fsynced, renamed over ``path``, and the directory is fsynced so the
    rename survives a power loss. Missing parent directories are created (durably).
    """
    view = memoryview(data).cast("B")
    return _write_atomic_with(path, lambda out: out.write(view), needed=view.nbytes)


def _write_atomic_with(path: Path, write: Callable[[BinaryIO], object], *,
                       needed: int) -> FileRecord:
    """`write_atomic` with the bytes written by ``write(file)`` (about ``needed`` of them);
    the record is read back from the written file in chunks (a large object is never held
    twice in memory). A write that fails for want of space raises `CheckpointError` saying
    so, with the path and the bytes (`_out_of_space`)."""
    path = Path(path)
    if is_temp_name(path.name):
        raise CheckpointError(f"{path}: file names starting with {TMP_PREFIX!r} are reserved")
    _make_dirs(path.parent)
    tmp = path.with_name(f"{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-{path.name[:200]}")
    try:
        with open(tmp, "xb") as out:
            write(out)
            out.flush()
            os.fsync(out.fileno())
        record = _record_of(tmp)
        os.replace(tmp, path)
    except Exception as error:
        written = tmp.stat().st_size if tmp.exists() else 0
        full = _out_of_space(error, path, needed - written)
        tmp.unlink(missing_ok=True)
        if full:
            raise CheckpointError(f"No space left on device for {path}: about {needed:,} "
                                  f"bytes to write, {written:,} written when the write failed, "
                                  f"{shutil.disk_usage(path.parent).free:,} free on its file "
                                  f"system now that the partial file is removed ({error})"
                                  ) from error
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return record


def _out_of_space(error: Exception, path: Path, still_needed: int) -> bool:
    """Whether a failed write ran out of space: an ENOSPC/EDQUOT anywhere in the error's
    chain, or (torch.save reports a short write as "unexpected pos", without the OS error)
    less room left on the file system than the write still needed."""
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        cause = cause.__cause__ or cause.__context__
    try:
        return shutil.disk_usage(path.parent).free < max(still_needed, 1)
    except OSError:
        return False


def _nbytes(obj: object) -> int:
    """The bytes of the tensors in ``obj`` (dicts, lists and tuples searched): about what
    ``torch.save`` writes of it."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


def _record_of(path: Path) -> FileRecord:
    """``path``'s SHA-256 and size, read in chunks."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as source:
        while chunk := source.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return FileRecord(digest.hexdigest(), size)


def save_object(path: Path, obj: object) -> FileRecord:
    """``torch.save`` ``obj`` to ``path`` atomically, streamed to the file (no in-memory
    copy of the serialised bytes). A tensor viewing part of a larger storage (a table
    group's member: `parallax.engine.tables.table_group`) is written as a copy of its own
    elements: ``torch.save`` writes a view's whole storage."""
    compact = _compact(obj)
    return _write_atomic_with(path, lambda out: torch.save(compact, out),
                              needed=_nbytes(compact))


def _compact(obj: object) -> object:
    """``obj`` (dicts, lists and tuples searched) with each tensor that views a larger
    storage replaced by a copy of its elements."""
    if isinstance(obj, torch.Tensor):
        if (obj.layout == torch.strided and obj.device.type != "meta"
                and obj.untyped_storage().nbytes() > obj.numel() * obj.element_size()):
            return obj.clone()
        return obj
    if type(obj) in (dict, OrderedDict):
        return type(obj)((key, _compact(value)) for key, value in obj.items())  # type: ignore[call-arg, attr-defined]
    if type(obj) is list:
        return [_compact(value) for value in obj]
    if type(obj) is tuple:
        return tuple(_compact(value) for value in obj)
    return obj


def load_object(path: Path, record: FileRecord, *, weights_only: bool = True) -> object:
    """Load what `save_object` wrote, after checking size and checksum against ``record``.
    Its tensors are memory-mapped from the file (``torch.load(mmap=True)``): a shard larger
    than memory loads, and only what is read is paged in.

    ``weights_only=True`` (torch's safe unpickler) loads tensors, containers and Python
    scalars/strings; pass False only for trusted files holding other objects.
    """
    path = Path(path)
    try:
        found = _record_of(path)
    except FileNotFoundError:
        raise CheckpointError(
            f"{path}: missing (manifest records {record.size} bytes)") from None
    except OSError as err:
        raise CheckpointError(f"{path}: cannot be read: {err}") from err
    _check_record(path, record, found.size, found.sha256)
    try:
        return torch.load(path, weights_only=weights_only, mmap=True)
    except Exception as err:
        raise CheckpointError(f"{path}: checksum matches but torch.load failed: {err}") from err


def write_manifest(directory: Path, manifest: Manifest) -> None:
    """Write ``directory/manifest.json`` atomically; call it only after every listed file is
    written, since its presence is what marks the checkpoint complete."""
    directory = Path(directory)
    where = directory / MANIFEST_NAME
    if manifest.format_version != FORMAT_VERSION:
        raise CheckpointError(
            f"{where}: cannot write format_version {manifest.format_version!r}; "
            f"this code writes version {FORMAT_VERSION}"
        )
    if not is_int(manifest.step, at_least=0):
        raise CheckpointError(f"{where}: step must be an int >= 0, got {manifest.step!r}")
    for name, record in manifest.files.items():
        _check_file_key(where, name)
        _check_record_fields(where, name, record.sha256, record.size)
    body = {
        "format_version": manifest.format_version,
        "step": manifest.step,
        "files": {k: {"sha256": r.sha256, "size": r.size} for k, r in manifest.files.items()},
        "meta": manifest.meta,
    }
    try:
        # One plain pass first turns tuples into lists and non-str keys into strings, so the
        # body checksummed here is exactly the one a reader parses back.
        body = json.loads(json.dumps(body, allow_nan=False))
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{where}: meta is not JSON-serialisable: {err}") from err
    document = {**body, "checksum": _body_checksum(body)}
    text = json.dumps(document, indent=2, sort_keys=True, ensure_ascii=True) + "\n"
    write_atomic(where, text.encode("ascii"))


def _read(path: Path, if_missing: str) -> bytes:
    """``path``'s bytes, or a `CheckpointError` naming it (``if_missing``: why it may be)."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing ({if_missing})") from None
    except OSError as err:
        raise CheckpointError(f"{path}: cannot be read: {err}") from err


def read_manifest(directory: Path) -> Manifest:
    """Read and check ``directory/manifest.json``: present, JSON, of a known format version,
    matching its own checksum, and well-formed. Does not look at the listed files."""
    where = Path(directory) / MANIFEST_NAME
    raw = _read(where, "the save was interrupted?")
    try:
        document = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        raise CheckpointError(f"{where}: not valid JSON: {err}") from None
    if not isinstance(document, dict):
        raise CheckpointError(f"{where}: expected a JSON object, got {type(document).__name__}")
    version = document.get("format_version")
    if version != FORMAT_VERSION or isinstance(version, bool):
        raise CheckpointError(
            f"{where}: format_version {version!r} is not supported (expected {FORMAT_VERSION})"
        )
    recorded = document.pop("checksum", None)
    actual = _body_checksum(document)
    if recorded != actual:
        raise CheckpointError(
            f"{where}: checksum mismatch: body has sha256 {actual}, manifest records {recorded!r}"
        )
    return _manifest_from_json(where, document)


def verify(directory: Path, manifest: Manifest | None = None) -> Manifest:
    """Check that every file the manifest lists exists with the recorded size and SHA-256.

    Reads the manifest from ``directory`` when none is given; returns the manifest checked.
    """
    directory = Path(directory)
    if manifest is None:
        manifest = read_manifest(directory)
    for name, record in manifest.files.items():
        path = directory / name
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size != record.size:
                    _check_record(path, record, size, None)
                digest = hashlib.file_digest(f, "sha256").hexdigest()
        except FileNotFoundError:
            raise CheckpointError(
                f"{path}: missing (manifest records {record.size} bytes)"
            ) from None
        except OSError as err:
            raise CheckpointError(f"{path}: cannot be read: {err}") from err
        _check_record(path, record, size, digest)
    return manifest


def newest_complete(root: str | os.PathLike[str], *, verify: bool = False) -> Path | None:
    """The step directory with the highest step whose manifest reads (and, with
    ``verify=True``, whose files all check out); None when there is none.

    Directories without a manifest (an interrupted save) or with a corrupt one are skipped
    with a warning, so a crash during a save resumes from the previous checkpoint.
    """
    for step, directory in sorted(_step_dirs(Path(root)), reverse=True):
        try:
            manifest = _read_step_manifest(directory, step)
            if verify:
                _verify(directory, manifest)
        except CheckpointError as err:
            logger.warning("skipping checkpoint %s: %s", directory, err)
            continue
        return directory
    return None


def find_checkpoint(path: str | os.PathLike[str], *, by_name: bool = False) -> Path | None:
    """The step directory ``path`` names: ``path`` itself when it is one, else the newest
    complete checkpoint under it (``path`` a checkpoint root, `newest_complete`); None when
    there is none (``path`` is no directory, or holds no complete checkpoint).

    ``path`` is a step directory when it holds a manifest, or, with ``by_name=True``, when it
    is named like one (complete or not: reading its manifest then says what is wrong, rather
    than searching below it and finding nothing).
    """
    path = Path(path)
    if (path / MANIFEST_NAME).exists() or (by_name and _STEP_RE.fullmatch(path.name)):
        return path
    return newest_complete(path)


def prune(root: str | os.PathLike[str], keep: int) -> None:
    """Delete complete checkpoints beyond the newest ``keep``, incomplete step directories
    older than the newest complete one, and leftover temporary files of kept checkpoints.

    "Complete" means the manifest reads (files are not re-hashed). Incomplete directories
    newer than the newest complete checkpoint are left alone: a save may be in progress.
    The newest complete checkpoint is never deleted.
    """
    if not is_int(keep, at_least=1):
        raise ArgumentError(f"prune: keep must be an int >= 1, got {keep!r}")
    root = Path(root)
    if not root.is_dir():
        return
    for leftover in root.glob(f"{_TRASH_PREFIX}*"):
        _remove_tree(leftover)
    complete: list[tuple[int, Path]] = []
    incomplete: list[tuple[int, Path]] = []
    for step, directory in sorted(_step_dirs(root), reverse=True):
        try:
            _read_step_manifest(directory, step)
        except CheckpointError:
            incomplete.append((step, directory))
        else:
            complete.append((step, directory))
    if not complete:
        return
    newest_step = complete[0][0]
    doomed = [d for _, d in complete[keep:]] + [d for s, d in incomplete if s < newest_step]
    for directory in doomed:
        logger.info("pruning checkpoint directory %s", directory)
        trash = root / f"{_TRASH_PREFIX}{directory.name}-{os.getpid()}-{secrets.token_hex(4)}"
        os.replace(directory, trash)
        _fsync_dir(root)
        _remove_tree(trash)
    for _, directory in complete[:keep]:
        for tmp in directory.rglob(f"{TMP_PREFIX}*"):
            if tmp.is_file():
                tmp.unlink(missing_ok=True)


_verify = verify  # newest_complete's ``verify`` parameter shadows the function


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every directory under ``root`` named exactly like `step_dir`."""
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _STEP_RE.fullmatch(entry.name)
        if match and entry.is_dir() and entry.name == step_dir(root, int(match[1])).name:
            found.append((int(match[1]), entry))
    return found


def _read_step_manifest(directory: Path, step: int) -> Manifest:
    """The manifest of a step directory, which must be for that very step."""
    manifest = read_manifest(directory)
    if manifest.step != step:
        raise CheckpointError(
            f"{directory / MANIFEST_NAME}: records step {manifest.step}, "
            f"but the directory is for step {step}"
        )
    return manifest


def _check_record(path: Path, record: FileRecord, size: int, digest: str | None) -> None:
    """Raise naming ``path`` when its size or (if given) digest differs from ``record``."""
    if size < record.size:
        raise CheckpointError(
            f"{path}: truncated: {size} bytes, manifest records {record.size}"
        )
    if size > record.size:
        raise CheckpointError(
            f"{path}: too long: {size} bytes, manifest records {record.size}"
        )
    if digest is not None and digest != record.sha256:
        raise CheckpointError(
            f"{path}: checksum mismatch: sha256 {digest}, manifest records {record.sha256}"
        )


def _body_checksum(body: dict[str, Any]) -> str:
    """SHA-256 of the canonical JSON of a manifest body (all but its ``checksum`` key)."""
    try:
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                               allow_nan=False)
    except (TypeError, ValueError):
        return "<body not canonical JSON>"
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()


def _manifest_from_json(where: Path, body: dict[str, Any]) -> Manifest:
    """Build a Manifest from a checked body, naming the first malformed field."""
    expected = {"format_version", "step", "files", "meta"}
    if set(body) != expected:
        raise CheckpointError(
            f"{where}: fields {sorted(body)} differ from the expected {sorted(expected)}"
        )
    step, files, meta = body["step"], body["files"], body["meta"]
    if not is_int(step, at_least=0):
        raise CheckpointError(f"{where}: step must be an int >= 0, got {step!r}")
    if not isinstance(files, dict):
        raise CheckpointError(f"{where}: files must be an object, got {type(files).__name__}")
    if not isinstance(meta, dict):
        raise CheckpointError(f"{where}: meta must be an object, got {type(meta).__name__}")
    records = {}
    for name, entry in files.items():
        _check_file_key(where, name)
        if not isinstance(entry, dict) or set(entry) != {"sha256", "size"}:
            raise CheckpointError(
                f"{where}: files[{name!r}] must be an object with sha256 and size, got {entry!r}"
            )
        _check_record_fields(where, name, entry["sha256"], entry["size"])
        records[name] = FileRecord(entry["sha256"], entry["size"])
    return Manifest(step=step, files=records, meta=meta, format_version=body["format_version"])


def _check_file_key(where: Path, name: object) -> None:
    """A listed file must be a relative path inside the step directory that is neither the
    manifest nor a temporary file."""
    if not isinstance(name, str):
        raise CheckpointError(f"{where}: file key {name!r} is not a string")
    parts = PurePosixPath(name).parts
    bad = (
        not parts
        or "\\" in name
        or PurePosixPath(name).is_absolute()
        or any(p in (".", "..") or is_temp_name(p) for p in parts)
        or name == MANIFEST_NAME
        or str(PurePosixPath(name)) != name
    )
    if bad:
        raise CheckpointError(
            f"{where}: file key {name!r} must be a normalised relative POSIX path inside the "
            f"step directory, not {MANIFEST_NAME!r} and with no part starting {TMP_PREFIX!r}"
        )


def _check_record_fields(where: Path, name: str, sha256: object, size: object) -> None:
    """A record holds a lowercase hex SHA-256 and a non-negative int size."""
    if not isinstance(sha256, str) or not _SHA256_RE.fullmatch(sha256):
        raise CheckpointError(
            f"{where}: files[{name!r}].sha256 must be 64 lowercase hex digits, got {sha256!r}"
        )
    if not is_int(size, at_least=0):
        raise CheckpointError(f"{where}: files[{name!r}].size must be an int >= 0, got {size!r}")


def _make_dirs(directory: Path) -> None:
    """Create ``directory`` and missing parents, fsyncing each new entry's parent."""
    if directory.is_dir():
        return
    _make_dirs(directory.parent)
    try:
        directory.mkdir()
    except FileExistsError:
        if not directory.is_dir():
            raise
        return
    _fsync_dir(directory.parent)


def _fsync_dir(directory: Path) -> None:
    """Make renames and creations in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_tree(path: Path) -> None:
    """Remove a renamed-away directory; leftovers are retried by the next `prune`."""
    try:
        shutil.rmtree(path)
    except OSError as err:
        logger.warning("could not remove %s: %s", path, err)
