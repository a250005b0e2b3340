"""Small text files written whole or not at all: a temporary file beside the target, renamed
over it, so a reader (another process, the elastic agent) sees the old text or the new, never
half of it. Not fsynced, unlike checkpoints (`parallax.checkpoint.files.write_atomic`): what
these files hold is cheap to lose to a power cut (a searched partition count, a worker's error
record)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["create_text", "replace_text"]


def replace_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file beside it (parent directories
    created); the temporary file is removed if anything fails, and the error raised."""
    _through_temporary(Path(path), text, os.replace)


def create_text(path: str | os.PathLike[str], text: str) -> bool:
    """Create ``path`` holding ``text``, whole, unless it exists: False then, and nothing is
    written (a claim two processes may race for: the temporary file is hard-linked into
    place, which fails if the target exists, so a reader never sees it empty)."""
    try:
        _through_temporary(Path(path), text, os.link)
    except FileExistsError:
        return False
    return True


def _through_temporary(path: Path, text: str, place: Callable[[str, Path], None]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "w") as out:
            out.write(text)
        place(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)  # gone after a rename; the link's spare name
