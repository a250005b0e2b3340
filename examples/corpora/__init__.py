"""Demo corpora for the examples and benchmarks (not part of the library): the KJV Bible,
KJV / Reina-Valera 1909 verse pairs and Fashion-MNIST from Debian packages, a tokenizer and an
LM dataset. Fetched into ``$PARALLAX_CACHE`` (or ``~/.cache/parallax``) by the launching
process: ``python examples/fetch_corpora.py kjv``."""

from __future__ import annotations

from pathlib import Path

__all__ = ["CORPORA", "fetch"]

CORPORA = ("kjv", "kjv-rv1909", "fashion-mnist")
"""Names `fetch` and ``examples/fetch_corpora.py`` accept."""


def fetch(name: str, cache_dir: Path | None = None) -> Path:
    """Fetch corpus ``name`` (one of `CORPORA`) into the cache unless it is there already;
    return its path.

    Example::

        corpora.fetch("kjv")   # before launching workers that read it
    """
    from corpora.fashion_mnist import fetch_fashion_mnist
    from corpora.kjv import fetch_kjv
    from corpora.rv1909 import fetch_verse_pairs

    fetchers = {"kjv": fetch_kjv, "kjv-rv1909": fetch_verse_pairs,
                "fashion-mnist": fetch_fashion_mnist}
    if name not in fetchers:
        raise ValueError(f"unknown corpus {name!r}; known: {', '.join(CORPORA)}")
    return fetchers[name](cache_dir)
