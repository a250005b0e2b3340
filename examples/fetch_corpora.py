"""Fetch demo corpora into the cache, where the network is reachable, before workers start.

    python examples/fetch_corpora.py kjv kjv-rv1909 fashion-mnist

Workers under ``parallax run --emulate-network`` cannot download (their namespaces reach only
each other): they fail at once naming this command when a corpus is missing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from corpora import CORPORA, fetch  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("corpora", nargs="+", metavar="CORPUS", choices=CORPORA,
                        help=f"one of: {', '.join(CORPORA)}")
    args = parser.parse_args(argv)
    for name in args.corpora:
        try:
            print(f"fetch_corpora: {name}: {fetch(name)}")
        except (RuntimeError, OSError) as err:
            print(f"fetch_corpora: error: fetching {name} failed: {err}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
