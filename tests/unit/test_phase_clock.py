"""A step's phases (`parallax.engine.diagnostics.phases`): self times of nested phases, nothing
timed outside a step or on another thread, an exception ends its phase and goes on, and a
phase costs a handful of Python calls (it opens several times in every step)."""

from __future__ import annotations

import cProfile
import threading

import pytest

from parallax.engine.diagnostics import phases
from parallax.engine.diagnostics.phases import PhaseClock


def test_a_nested_phase_counts_for_itself_not_for_its_parent(monkeypatch) -> None:
    # the clock's own reads on a clock that moves only when the test says (no timed
    # assertion: a loaded host stretches real sleeps)
    now = [0]
    monkeypatch.setattr(phases.time, "perf_counter_ns", lambda: now[0])

    def wait(seconds: float) -> None:
        now[0] += round(seconds * 1e9)

    clock = PhaseClock(0)
    clock.begin(1)
    with clock.phase("forward"):
        wait(0.02)
        with clock.phase("pull"):
            wait(0.03)
            with clock.phase("pull"):  # already running: not opened twice
                wait(0.01)
        wait(0.005)
    wait(0.001)  # in the step, in no phase
    clock.end()
    assert clock.seconds["pull"] == pytest.approx(0.04)
    assert clock.seconds["forward"] == pytest.approx(0.025)
    assert clock.seconds["step"] == pytest.approx(0.066)


def test_nothing_is_timed_outside_a_step_or_on_another_thread() -> None:
    clock = PhaseClock(0)
    with clock.phase("pull"):  # no step begun
        pass
    assert "pull" not in clock.seconds
    clock.begin(1)
    worker = threading.Thread(target=lambda: phases.phase("push").__enter__())
    worker.start()
    worker.join()
    with phases.phase("push"):  # the running step's clock, on its own thread
        pass
    clock.end()
    assert set(clock.seconds) == {"push", "step"}
    assert phases.active() is None


def test_an_exception_ends_its_phase_and_propagates() -> None:
    clock = PhaseClock(0)
    clock.begin(1)
    with pytest.raises(KeyError), clock.phase("push"):
        raise KeyError("x")
    with clock.phase("dense update"):  # the stack is clean: this one is timed on its own
        pass
    clock.end()
    assert {"push", "dense update"} <= set(clock.seconds)
    assert not clock.running()


def test_a_phase_costs_a_handful_of_python_calls() -> None:
    clock = PhaseClock(0)
    clock.begin(1)

    def ten_phases() -> None:
        for _ in range(10):
            with phases.phase("push"):
                pass

    with phases.phase("push"):  # the first makes the clock's context for the name
        pass
    profile = cProfile.Profile()
    profile.runcall(ten_phases)
    clock.end()
    calls = sum(entry.callcount for entry in profile.getstats()
                if "ten_phases" not in str(entry.code) and "_lsprof" not in str(entry.code))
    # phase, Timed.__enter__/__exit__, its start and stop and their builtins (the clock's
    # two reads, the thread's id): 8 a phase (the context is made once per name; the
    # profiler's flag is read once a step), where a generator context in a generator
    # context took 28
    assert calls <= 8 * 10, calls


def test_a_phase_nested_in_itself_is_timed_once_by_its_outermost_block() -> None:
    clock = PhaseClock(0)
    clock.begin(1)
    with clock.phase("push"):
        with clock.phase("push"), clock.phase("pull"):
            pass
        assert clock.running() == ["push"]  # the inner left it open
    assert not clock.running()
    clock.end()
    assert {"push", "pull"} <= set(clock.seconds)


def test_phases_a_failed_step_left_running_are_dropped_at_the_next_step() -> None:
    clock = PhaseClock(0)
    clock.begin(1)
    block = clock.phase("push")
    block.__enter__()  # the step fails inside this block and inside a hook's phase
    assert clock.open("backward") and clock.running() == ["push", "backward"]
    clock.begin(2)
    assert clock.running() == [] and not clock.seconds
    block.__exit__(None, None, None)  # the block ends later: nothing timed, nothing broken
    with clock.phase("push"):
        assert clock.running() == ["push"]
    assert clock.open("backward")
    clock.close("backward")
    clock.end()
    assert clock.running() == [] and set(clock.seconds) == {"push", "backward", "step"}
