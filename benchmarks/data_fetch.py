"""Fetching a workload's data before its workers start, in a module that does not import torch:
every benchmark script's parent process calls it, and importing torch there cost each script
about 2 s of CPU (the suite runs about fifteen of them)."""

from __future__ import annotations

import demo_data  # noqa: F401  (examples/corpora on sys.path)


def fetch_data(name: str, options: dict) -> None:
    """Fetch the corpora workload ``name`` with ``options`` reads, into the cache, in *this*
    process. Launchers call it before starting workers: under ``--emulate-network`` workers
    cannot download (`corpora.cache.require_online`)."""
    from corpora import fetch

    if name == "lm" and options.get("corpus", "zipf") == "kjv":
        fetch("kjv")
    elif name == "nmt":
        fetch("kjv-rv1909")
    elif name == "cnn":
        fetch("fashion-mnist")
    elif name == "recsys":
        from recsys import widedeep_wheel

        widedeep_wheel()
