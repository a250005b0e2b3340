"""Small text files written whole or not at all: a temporary file beside the target, renamed
over it, so a reader (another process, the elastic agent) sees the old text or the new, never
half of it. Not fsynced, unlike checkpoints (`parallax.checkpoint.files.write_atomic`): what
these files hold is cheap to lose to a power cut (a searched partition count, a worker's error
record)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["replace_text"]


def replace_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file beside it (parent directories
    created); the temporary file is removed if anything fails, and the error raised."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "w") as out:
            out.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
