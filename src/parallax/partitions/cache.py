"""Searched partition counts remembered across runs (`Config.partition_cache`).

An entry is keyed by a hash of what the best count depends on: the model's parameters (names,
shapes, dtypes), the searched tables, the architecture and its options, the batch's shapes and
the cluster shape. The entry keeps the signature itself (readable), the samples and the fit, so
`parallax plan` can show where a count came from. The file is JSON, rewritten atomically; a
damaged file is reported and replaced, never fatal.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from parallax.atomic import replace_text

__all__ = ["cache_key", "load_entry", "store_entry"]

log = logging.getLogger("parallax")


def cache_key(signature: dict[str, Any]) -> str:
    text = json.dumps(signature, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _read(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        entries, why = None, str(error)
    else:
        why = "not a JSON object"
    if not isinstance(entries, dict):
        log.warning("parallax: ignoring the unreadable partition cache %s (%s); it will be "
                    "rewritten", path, why)
        return {}
    return entries


def load_entry(path: str | os.PathLike[str], key: str) -> dict[str, Any] | None:
    """The cached entry for ``key`` (None when absent or unusable)."""
    entry = _read(Path(path).expanduser()).get(key)
    if not isinstance(entry, dict) or not isinstance(entry.get("partitions"), int):
        return None
    return entry


def store_entry(path: str | os.PathLike[str], key: str, entry: dict[str, Any]) -> None:
    """Add or replace ``key`` (atomic: a crash leaves the previous file)."""
    target = Path(path).expanduser()
    entries = _read(target)
    entries[key] = entry
    replace_text(target, json.dumps(entries, indent=1, sort_keys=True))
