"""CPU time by thread and a CPU-timed profile (`benchmarks/thread_cpu.py`): a thread that
computes is charged, one that waits is not."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from thread_cpu import THREAD_KINDS, cpu_profile, thread_cpu_s  # noqa: E402

pytestmark = [pytest.mark.unit,
              pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs /proc")]


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_the_thread_that_computes_is_charged() -> None:
    before = thread_cpu_s()
    _spin(0.3)  # the main thread computes
    helper = threading.Thread(target=_spin, args=(0.3,))
    helper.start()
    helper.join()
    waiter = threading.Thread(target=time.sleep, args=(0.3,))  # waits: no CPU
    waiter.start()
    waiter.join()
    after = thread_cpu_s()
    spent = {kind: after[kind] - before[kind] for kind in THREAD_KINDS}
    assert spent["main"] >= 0.2, spent
    # the helper is gone by now: a thread's ticks leave /proc with it, so only the main
    # thread's are certain; the ended threads never count against it
    assert spent["main"] < 0.3 + 0.3 + 0.1, spent
    # nothing here is gloo's: a helper or waiter mislabelled so would add 0.2 s or more; a
    # process group an earlier test in this process made may leave a gloo thread that ticks
    # once (0.01 s seen in a fresh-clone CI run)
    assert spent["gloo"] < 0.05, spent


def _step(waits: list[float]) -> None:
    _spin(0.004)
    time.sleep(0.004)  # a wait on a peer: no CPU
    waits.append(1.0)


def test_a_cpu_profile_counts_computing_not_waiting(tmp_path: Path) -> None:
    waits: list[float] = []
    cpu_profile(lambda: _step(waits), 10, tmp_path / "x.prof", "spin")
    text = (tmp_path / "x.txt").read_text()
    assert len(waits) == 10 and (tmp_path / "x.prof").stat().st_size > 0
    per_step_ms = float(text.split("CPU time: ")[1].split(" ms")[0])
    assert 3.5 <= per_step_ms < 7.5, text[:300]  # 4 ms computed, the 4 ms sleep not charged
    assert "_spin" in text and "Python calls per step" in text
