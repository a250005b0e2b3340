"""The benchmark harness runs end to end at tiny sizes, so it cannot rot (full runs: see
BENCHMARKS.md)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("tc"),
                    reason="the emulated network needs root and iproute2")
def test_compare_smoke(tmp_path: Path) -> None:
    out = tmp_path / "compare.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "compare.py"), "--machines", "2",
           "--nproc-per-machine", "1", "--steps", "2", "--warmup", "1", "--vocab", "2000",
           "--no-plot", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = {r["system"]: r for r in json.loads(out.read_text())}
    assert set(results) == {"hybrid", "optps", "ps", "allreduce", "ddp-sparse", "ddp-dense"}
    for system, result in results.items():
        assert result["median_step_s"] > 0 and result["items_per_s"] > 0, system
        assert result["wire_bytes_per_machine_step"] > 0, system
    assert "| hybrid |" in proc.stdout and "wire bytes/machine/step" in proc.stdout
