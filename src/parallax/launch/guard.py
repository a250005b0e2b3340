"""One machine's agent, ended with the launcher that started it (over ssh or on this host).

``python -m parallax.launch.guard -- ARGV...`` (``ssh host ...`` for a remote machine; an
emulated machine's namespace or this host, `parallax.launch.executors.guarded`) starts ARGV
(``parallax run --machine-index I ...``) in a session of its own and waits. When the agent ends,
the guard exits with its status. When the launcher goes first (it stopped the machines: Ctrl-C,
a failure elsewhere; or it was killed outright), the guard's standard input (the ssh session,
or a pipe from the launcher) reaches end of file, or the launcher's SIGTERM arrives: it sends
SIGTERM to the agent (which stops its workers), then to every process still below it after the
grace period (the agent's workers run in sessions of their own, so a process group is not
enough: the tree is found through /proc, and the guard is a child subreaper, so orphans stay in
it), and SIGKILL to what is left a second later. No process outlives the job, without relying
on a terminal's hang-up.
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
#: after the launcher's SIGTERM: shorter than the launcher's own grace before its SIGKILL
#: (`parallax.launch.executors.launch_machines`), so the guard always gets to end its tree
SIGNALLED_GRACE_S = 5.0


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


def end_agent(agent: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM the agent, which stops its own workers as it does on a launcher's Ctrl-C;
    then what is left below the guard after ``grace_s`` (`stop_below`, one more second)."""
    _signal(agent.pid, signal.SIGTERM)
    try:
        agent.wait(timeout=max(0.0, grace_s - 1.0))
    except subprocess.TimeoutExpired:
        pass
    stop_below(os.getpid(), grace_s=1.0)


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
    signalled: list[int] = []
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda number, _frame: signalled.append(number))
    agent = subprocess.Popen(argv, start_new_session=True, stdin=subprocess.DEVNULL)
    # (no reader thread: one blocked in a read of stdin aborts the interpreter at exit)
    hung_up = False
    while agent.poll() is None and not hung_up and not signalled:
        readable, _, _ = select.select([sys.stdin.fileno()], [], [], 0.2)
        if readable and not os.read(sys.stdin.fileno(), 1 << 12):
            hung_up = True  # end of file: the launcher (or its ssh session) is gone
    if agent.poll() is None:  # the launcher ended first, or stopped this machine
        end_agent(agent, SIGNALLED_GRACE_S if signalled else GRACE_S)
        return 128 + signalled[0] if signalled else 143
    stop_below(os.getpid(), grace_s=0)  # anything the agent left behind
    return agent.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
