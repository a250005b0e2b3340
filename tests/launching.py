"""Launching a test's worker program on the local emulated cluster (`parallax run`), the way
the integration tests that train in worker processes do."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_worker(script: str, *args: str, machines: int = 2, nproc_per_machine: int = 2,
               timeout_s: float = 600) -> subprocess.CompletedProcess[str]:
    """``tests/scripts/<script>`` with ``args`` under ``parallax run`` on ``machines`` x
    ``nproc_per_machine``; fails the test, with the end of stderr, unless it exits 0."""
    cmd = [sys.executable, "-m", "parallax.cli", "run", "--machines", str(machines),
           "--nproc-per-machine", str(nproc_per_machine),
           str(ROOT / "tests" / "scripts" / script), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc
