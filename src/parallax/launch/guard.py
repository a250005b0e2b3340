"""The remote end of an ssh launch: runs one machine's agent and ends it with the ssh session.

``ssh host python -m parallax.launch.guard -- ARGV...`` starts ARGV (``parallax run
--machine-index I ...``) in a session of its own and waits. When the agent ends, the guard
exits with its status. When the ssh session ends first (the launcher stopped it: Ctrl-C, a
failure elsewhere, the launcher killed), the guard's standard input reaches end of file: it
sends SIGTERM to every process below it (the agent's workers run in sessions of their own, so
a process group is not enough: the tree is found through /proc, and the guard is a child
subreaper, so orphans stay in it), then SIGKILL to what is left after the grace period. No
remote process outlives the job, without relying on a terminal's hang-up.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

GRACE_S = 10.0


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children first found, then theirs), from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(), []):
            found.append(child)
            queue.append(child)
    return found


def stop_below(pid: int, grace_s: float = GRACE_S) -> None:
    """SIGTERM everything below ``pid``; SIGKILL what is alive after ``grace_s``."""
    tree = descendants(pid)
    for target in tree:
        _signal(target, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p) for p in tree):
        time.sleep(0.1)
    for target in [*descendants(pid), *tree]:
        _signal(target, signal.SIGKILL)


def _become_subreaper() -> None:
    """Processes orphaned below this one are re-parented to it (not to init), so that
    `descendants` still finds a worker whose agent has died (Linux prctl)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def main(argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python -m parallax.launch.guard -- COMMAND...", file=sys.stderr)
        return 2
    _become_subreaper()
    agent = subprocess.Popen(argv, start_new_session=True, stdin=subprocess.DEVNULL)
    # (no reader thread: one blocked in a read of stdin aborts the interpreter at exit)
    hung_up = False
    while agent.poll() is None and not hung_up:
        readable, _, _ = select.select([sys.stdin.fileno()], [], [], 0.2)
        if readable and not os.read(sys.stdin.fileno(), 1 << 12):
            hung_up = True  # end of file: the ssh session is gone
    if agent.poll() is None:  # the session ended first
        stop_below(os.getpid())
        return 143
    stop_below(os.getpid(), grace_s=0)  # anything the agent left behind
    return agent.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
