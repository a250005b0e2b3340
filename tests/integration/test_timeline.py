"""Where a step's time goes (`parallax.engine.diagnostics.phases`): ``parallax run --timeline
FILE`` on 2 machines x 2 workers writes one Chrome trace (trace-event format) with every phase of
every rank's steps, and the phases cover the steps they belong to; ``runner.stats()`` holds the
same phases' self times, which add up to the step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from parallax.engine.diagnostics.phases import PHASES

ROOT = Path(__file__).resolve().parents[2]
WORLD, STEPS = 4, 4


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("timeline")
    cmd = [sys.executable, "-m", "parallax.cli", "run", "--timeline", str(out / "trace.json"),
           "--machines", "2", "--nproc-per-machine", "2",
           str(ROOT / "tests" / "scripts" / "timeline_worker.py"), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"timeline written to {out / 'trace.json'}" in proc.stderr
    return out


def _events(run: Path) -> list[dict]:
    trace = json.loads((run / "trace.json").read_text())
    return trace["traceEvents"]


def test_the_trace_is_trace_event_json_with_a_track_per_rank_and_phase(run) -> None:
    events = _events(run)
    assert not list(run.glob("trace.json.rank*.json")), "the ranks' parts are merged"
    for event in events:
        assert event["ph"] in ("X", "M")
        assert isinstance(event["pid"], int) and isinstance(event["name"], str)
        if event["ph"] == "X":
            assert event["dur"] >= 0 and event["ts"] > 0 and "tid" in event
    names = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "process_name"}
    assert names == {(r, f"rank {r}") for r in range(WORLD)}
    tracks = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    assert {name for pid, name in tracks if pid == 0} == {"step", *PHASES}


def test_every_rank_ran_every_phase_in_every_step(run) -> None:
    complete = [e for e in _events(run) if e["ph"] == "X"]
    for rank in range(WORLD):
        mine = [e for e in complete if e["pid"] == rank]
        assert sorted(e["args"]["step"] for e in mine if e["name"] == "step") == list(
            range(1, STEPS + 1))
        assert {e["name"] for e in mine} == {"step", *PHASES}, rank
        for step in range(1, STEPS + 1):
            ran = {e["name"] for e in mine if e["args"]["step"] == step}
            every_step = set(PHASES) - {"checkpoint"}  # saved every 2 steps
            assert ran >= every_step, (rank, step, every_step - ran)
            assert ("checkpoint" in ran) == (step % 2 == 0)


def _covered(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def test_the_phases_cover_their_steps_within_ten_percent(run) -> None:
    # Summed over a rank's steps: a gap between two phases in which the OS ran another of the
    # 4 processes on this 2-core host may leave one short step under 90 % (seen once: 81 %),
    # whereas work left out of every phase shows in every step.
    complete = [e for e in _events(run) if e["ph"] == "X"]
    for rank in range(WORLD):
        covered = total = 0.0
        for step in range(1, STEPS + 1):
            here = [e for e in complete if e["pid"] == rank and e["args"]["step"] == step]
            whole = next(e for e in here if e["name"] == "step")
            begin, end = whole["ts"], whole["ts"] + whole["dur"]
            phases = [(max(e["ts"], begin), min(e["ts"] + e["dur"], end)) for e in here
                      if e["name"] != "step"]
            covered += _covered(phases)
            total += whole["dur"]
            assert all(begin <= e["ts"] and e["ts"] + e["dur"] <= end + 1 for e in here)
        assert covered >= 0.9 * total, (rank, covered / total)


def test_stats_hold_the_self_times_which_add_up_to_the_step(run) -> None:
    for rank in range(WORLD):
        phases = json.loads((run / f"phases-{rank}.json").read_text())
        assert set(phases) == {*PHASES, "other", "step"}
        assert all(value >= 0 for value in phases.values())
        parts = sum(phases[name] for name in PHASES)
        assert parts + phases["other"] == pytest.approx(phases["step"], rel=1e-9)
        assert phases["other"] <= 0.1 * phases["step"], phases
        assert phases["forward"] > 0 and phases["push"] > 0 and phases["dense sync"] > 0
