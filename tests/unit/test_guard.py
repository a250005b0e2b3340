"""The guard every machine's agent runs under (`parallax.launch.guard`) ends the agent and every
process below it when the launcher goes: its pipe closes (the launcher killed outright) or its
SIGTERM arrives (the launcher stopping the machines); the agent's own end passes through."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parallax.launch.guard import _alive  # the guard's own test of a live process

# An "agent" that starts a "worker" in a session of its own (as torch elastic does), writes
# both pids, and would run for a minute.
AGENT = """
import subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                          start_new_session=True)
open(sys.argv[1], "w").write(f"{worker.pid} " + str(__import__("os").getpid()))
time.sleep(60)
"""


def _start(tmp_path: Path) -> tuple[subprocess.Popen[bytes], list[int]]:
    pids = tmp_path / "pids"
    guard = subprocess.Popen([sys.executable, "-m", "parallax.launch.guard", "--",
                              sys.executable, "-c", AGENT, str(pids)],
                             stdin=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 30
    while not (pids.exists() and len(pids.read_text().split()) == 2):
        assert time.monotonic() < deadline, "the agent never started"
        time.sleep(0.05)
    return guard, [int(p) for p in pids.read_text().split()]


@pytest.mark.parametrize("launcher_goes", ["killed", "stops the machine"])
def test_the_agent_and_its_workers_end_with_the_launcher(tmp_path: Path,
                                                         launcher_goes: str) -> None:
    guard, pids = _start(tmp_path)
    try:
        if launcher_goes == "killed":  # its end of the pipe closes with it
            assert guard.stdin is not None
            guard.stdin.close()
        else:
            os.killpg(guard.pid, signal.SIGTERM)
        code = guard.wait(timeout=15)
        assert code == 143
        deadline = time.monotonic() + 5
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in pids if _alive(p)]
    finally:
        for pid in [guard.pid, *pids]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_the_agents_own_status_passes_through(tmp_path: Path) -> None:
    guard = subprocess.Popen([sys.executable, "-m", "parallax.launch.guard", "--",
                              sys.executable, "-c", "raise SystemExit(7)"],
                             stdin=subprocess.PIPE)  # held open, as the launcher holds it
    assert guard.wait(timeout=30) == 7
    assert guard.stdin is not None
    guard.stdin.close()
