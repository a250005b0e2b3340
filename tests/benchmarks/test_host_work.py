"""`benchmarks/host_work.py` counts the host work per step through both doors, at one worker and
at 1 machine x 2 workers (against DDP there), and the counts cannot grow back unseen: the
aten operators and collectives per step are deterministic and may not exceed today's, the
Python calls not by more than cProfile's own drift. What the plan decides from timings is
pinned (one partition per table, no leader hop, Runner.step's push after the backward): the
partition search and the local-aggregation trial choose by measured steps, and the early push
groups tables by the measured gaps between their gradients (a loaded host splits a group:
one all_to_all more), and each choice is work of its own. When the engine's
work falls, lower the ceilings to the new counts (the record that measured them names the
commit)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

# (workers, door) -> parallax's counts per step today, the largest over ranks (records
# host-counts-*/c2623e7 set them); plain PyTorch's and DDP's beside them.
CEILINGS = {
    (1, "distribute"): {"aten_ops_per_step": 261, "python_calls_per_step": 480,
                        "collectives_per_step": 0},
    (1, "runner"): {"aten_ops_per_step": 276, "python_calls_per_step": 484,
                    "collectives_per_step": 0},
    (2, "distribute"): {"aten_ops_per_step": 644, "python_calls_per_step": 1602,
                        "collectives_per_step": 6, "collective_bytes_per_step": 27033},
    (2, "runner"): {"aten_ops_per_step": 700, "python_calls_per_step": 1632,
                    "collectives_per_step": 3, "collective_bytes_per_step": 26985},
}
# 2: DDP over the model, its one AllReduce of every parameter's float32 gradient
PLAIN = {1: {"aten_ops_per_step": 248, "collectives_per_step": 0},
         2: {"aten_ops_per_step": 290, "collectives_per_step": 1,
             "collective_bytes_per_step": 4 * (2 * 2000 * 16 + 4 * 16 * 32 + 2 * 4 * 16)}}
PYTHON_DRIFT = 1.01  # cProfile counts a few calls more in some runs (collection, lazy paths)


@pytest.mark.parametrize(("workers", "door"), sorted(CEILINGS))
def test_host_work_counts_stay_under_their_ceilings(tmp_path: Path, workers: int,
                                                    door: str) -> None:
    out = tmp_path / "host_work.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "host_work.py"), "--door", door,
         "--workers", str(workers), "--partitions", "1", "--local-aggregation", "off",
         "--no-overlap-push", "--steps", "80", "--rounds", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["settings"]["door"] == door and len(record["ranks"]) == workers
    plain, ours = record["systems"]["plain"], record["systems"]["parallax"]
    for row in (plain, ours):
        assert row["kernel_launches_per_step"] == 0 == row["device_waits_per_step"]  # CPU
        assert len(row["step_ms_rounds"]) == 1 and row["step_ms_median"] > 0
    assert {key: plain[key] for key in PLAIN[workers]} == PLAIN[workers], (
        "the plain program's counts moved: torch changed, or the benchmark's program did")
    ceiling = CEILINGS[(workers, door)]
    grown = {key: (ours[key], limit) for key, limit in ceiling.items()
             if ours[key] > limit * (PYTHON_DRIFT if key.startswith("python") else 1)}
    assert not grown, f"host work per step grew past its ceiling (now, ceiling): {grown}"
    assert "| parallax |" in proc.stdout


def test_the_bytes_handed_to_collectives_are_each_ones_sent_input() -> None:
    host_work = pytest.importorskip("host_work")

    def event(name: str, shapes: list, dtypes: list[str]) -> SimpleNamespace:
        return SimpleNamespace(name=name, structured_input_shapes=shapes, input_dtypes=dtypes)

    events = [event("aten::add", [[3]], ["float"]),
              event("c10d::alltoall_base_", [[6], [10], [], []], ["int", "long int", "", ""]),
              event("c10d::_allgather_base_", [[20], [10]], ["double", "double"]),
              event("c10d::allreduce_", [[[10], [2, 3]], []], ["TensorList", ""]),
              event("c10d::barrier", [[]], [""])]
    # the a2a's send buffer (10 int64), the gather's input (10 float64); the list apart
    assert host_work.sent_by_collectives(events) == (10 * 8 + 10 * 8, 16)
    with pytest.raises(SystemExit, match="c10d::recv_anysource_"):
        host_work.sent_by_collectives([event("c10d::recv_anysource_", [[4]], ["float"])])
    with pytest.raises(SystemExit, match="c10::Float8"):
        host_work.sent_by_collectives([event("c10d::allreduce_", [[4]], ["c10::Float8"])])
