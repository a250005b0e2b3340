"""`benchmarks/host_work.py` counts one worker's host work per step through both doors at a
tiny size: its record holds the counts and the times, and parallax's counts exceed the plain
loop's (the engine's work is what it measures)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("door", ["distribute", "runner"])
def test_host_work_counts_both_doors(tmp_path: Path, door: str) -> None:
    out = tmp_path / "host_work.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "host_work.py"), "--door", door,
         "--vocab", "300", "--steps", "12", "--rounds", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["settings"]["door"] == door
    plain, ours = record["systems"]["plain"], record["systems"]["parallax"]
    for row in (plain, ours):
        assert row["aten_ops_per_step"] > 0 and row["python_calls_per_step"] > 0
        assert row["kernel_launches_per_step"] == 0 == row["device_waits_per_step"]  # CPU
        assert len(row["step_ms_rounds"]) == 1 and row["step_ms_median"] > 0
    assert ours["aten_ops_per_step"] > plain["aten_ops_per_step"]
    assert "| parallax |" in proc.stdout
