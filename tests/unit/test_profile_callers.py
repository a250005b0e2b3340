"""The host synchronisations of a profile, counted by the Python lines that ask for them
(`benchmarks/profile_callers.py`): from a real CPU profile's trace, and by the containment rule
on a hand-made trace (frames of another thread, or that end before the operator, are not its
callers)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from profile_callers import callers_of, report, trace_events  # noqa: E402

pytestmark = pytest.mark.unit


def _reads_back(x: torch.Tensor) -> float:
    return float(x.sum().item())


def _loop_body(x: torch.Tensor) -> float:
    return _reads_back(x) + 1.0


def test_a_real_profile_names_the_lines_that_read_back(tmp_path: Path) -> None:
    x = torch.randn(16)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                with_stack=True) as prof:
        for _ in range(3):
            _loop_body(x)
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    counts = callers_of(trace_events(trace))
    ours = {callers: n for (name, callers), n in counts.items()
            if name == "aten::_local_scalar_dense"}
    assert sum(ours.values()) == 3, counts
    (callers,) = ours
    frames = callers.split(" <- ")
    assert "_reads_back" in frames[0] and "_loop_body" in frames[1], callers
    assert not any("torch/" in frame for frame in frames)
    assert "(1/step)" in report(counts, steps=3)


def _span(name: str, ts: float, dur: float, tid: int = 1, cat: str = "python_function"
          ) -> dict[str, object]:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}


def test_only_enclosing_frames_of_the_same_thread_are_callers() -> None:
    events = [
        _span("app.py(1): main", 0, 100),
        _span("app.py(5): finished_before", 10, 5),
        _span("app.py(9): step", 20, 50),
        _span("torch/_tensor.py(3): item", 30, 10),
        _span("app.py(40): other_thread", 0, 100, tid=2),
        _span("cudaStreamSynchronize", 32, 2, cat="cuda_runtime"),
        _span("cudaStreamSynchronize", 80, 2, tid=3, cat="cuda_runtime"),
        _span("aten::add", 33, 1, cat="cpu_op"),
    ]
    counts = callers_of(events)
    assert counts == {("cudaStreamSynchronize", "app.py(9): step <- app.py(1): main"): 1,
                      ("cudaStreamSynchronize", ""): 1}
    assert "(no Python frame)" in report(counts)
