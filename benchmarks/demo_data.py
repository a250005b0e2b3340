"""Puts the demo corpora (``examples/corpora``: not part of the library) on ``sys.path`` for
the benchmarks: ``import demo_data`` before ``import corpora``."""

import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))
