"""Where a machine's processes start: here, inside a network namespace, or over ssh.

An executor turns a command into the command that runs it on one machine. `launch_machines`
starts one torch elastic agent per machine through its executor (``parallax run
--machine-index I``), so the same launcher serves a real cluster over ssh and an emulated one
in namespaces, and stops them all when one fails.
"""

from __future__ import annotations

import collections
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, TypeAlias

from parallax.cluster import ResourceSpec
from parallax.errors import ArgumentError
from parallax.launch.netem import netns_exec


def omp_threads(workers: int) -> str:
    """``OMP_NUM_THREADS`` for ``workers`` processes sharing this host's cores: the user's own
    setting when there is one, else the cores shared out evenly (at least one each).

    Without it each worker sizes its OpenMP pool for the whole host, and the oversubscribed
    threads spin against each other (several times slower steps)."""
    return os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // workers))


def guarded(argv: Sequence[str]) -> list[str]:
    """``argv`` (``python -m parallax.cli run ...``) under `parallax.launch.guard`, which ends
    it and every process below it when its standard input (a pipe from the launcher) closes:
    a launcher killed outright (SIGKILL, out of memory) leaves no agent training on alone,
    which the chaos soak found an emulated machine's agent did."""
    return [argv[0], "-m", "parallax.launch.guard", "--", *argv]


class LocalExecutor:
    """Run on this host, under `guarded`."""

    def command(self, argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
        return guarded(argv)


@dataclass
class NamespaceExecutor:
    """Run inside a network namespace of this host (an emulated machine), under `guarded`."""

    namespace: str

    def command(self, argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
        return [*netns_exec(self.namespace), *guarded(argv)]


# Variables a job's processes read that the launcher's environment may set: forwarded to
# every remote machine (with --env NAME[=VALUE] for others), as horovodrun -x does.
FORWARDED_PREFIXES = ("PARALLAX_", "TORCH_", "NCCL_", "GLOO_", "OMP_", "MKL_", "CUDA_")
FORWARDED_NAMES = ("PYTHONPATH", "PYTHONHASHSEED", "VIRTUAL_ENV")


def forwarded_environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The launcher's variables a remote machine's processes get (`FORWARDED_PREFIXES`,
    `FORWARDED_NAMES`), then ``extra``."""
    chosen = {k: v for k, v in os.environ.items()
              if k.startswith(FORWARDED_PREFIXES) or k in FORWARDED_NAMES}
    return {**chosen, **(extra or {})}


@dataclass(frozen=True)
class SshOptions:
    """How to reach the other hosts: ssh's user, port, identity file and ``-o`` options, and
    the Python to run there (by default this one's path: the same environment, on a shared or
    identically laid-out file system). Always BatchMode (never a password prompt)."""

    user: str | None = None
    port: int | None = None
    identity: str | None = None
    options: tuple[str, ...] = ()
    python: str = sys.executable
    connect_timeout_s: int = 10

    def argv(self, host: str) -> list[str]:
        # ssh keeps the first value it is given for an option: BatchMode first (never
        # overridden), the user's options before our ConnectTimeout default
        cmd = ["ssh", "-o", "BatchMode=yes"]
        if self.port is not None:
            cmd += ["-p", str(self.port)]
        if self.identity is not None:
            cmd += ["-i", self.identity]
        for option in self.options:
            cmd += ["-o", option]
        cmd += ["-o", f"ConnectTimeout={self.connect_timeout_s}"]
        return [*cmd, f"{self.user}@{host}" if self.user else host]


@dataclass
class SshExecutor:
    """Run on another host over ssh, in ``workdir`` (which must hold the same files), under
    `parallax.launch.guard`, which ends the command when the ssh session ends."""

    host: str
    workdir: str = field(default_factory=os.getcwd)
    options: SshOptions = field(default_factory=SshOptions)
    remote = True

    def command(self, argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
        # ssh passes one string to the remote shell: quote every piece of it. argv[0] is this
        # host's Python; the remote host runs its own (options.python).
        python = self.options.python
        assignments = [f"{key}={shlex.quote(value)}" for key, value in env.items()]
        remote = " ".join(["cd", shlex.quote(self.workdir), "&&", "exec", "env", *assignments,
                           shlex.join([python, "-m", "parallax.launch.guard", "--", python,
                                       *argv[1:]])])
        return [*self.options.argv(self.host), remote]


Executor = LocalExecutor | NamespaceExecutor | SshExecutor


@dataclass
class _Machine:
    """One machine's agent (or its ssh session), with the end of what it printed to stderr."""

    index: int
    where: str  # "host 10.0.0.2 (resources.txt line 2)"
    proc: subprocess.Popen[bytes]
    over_ssh: bool
    tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=30))
    reader: threading.Thread | None = None

    def relay_stderr(self) -> None:
        """Copy the agent's stderr to ours as it comes, keeping its last lines."""
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            line = raw.decode(errors="replace")
            self.tail.append(line.rstrip("\n"))
            sys.stderr.write(line)
            sys.stderr.flush()

    def cause(self) -> str:
        """The most telling line of what it printed: an ssh error, a Python exception."""
        lines = [line.strip() for line in self.tail if line.strip()]
        for line in reversed(lines):
            if self.over_ssh and (line.startswith("ssh:") or "Permission denied" in line
                                  or "Host key verification failed" in line):
                return line
        for line in reversed(lines):
            if "Error" in line or "error" in line:
                return line
        return lines[-1] if lines else "nothing printed"

    def describe_exit(self, code: int) -> str:
        if self.over_ssh and code == 255:
            return "ssh failed (exit status 255)"
        return f"exit status {code}"


def launch_machines(spec_file: str, spec: ResourceSpec, cmd: Sequence[str],
                    executors: Sequence[Executor], *, master_port: int,
                    env: Mapping[str, str] | None = None, grace_s: float = 10.0) -> int:
    """Start ``parallax run --machine-index I`` on every machine through its executor and wait.

    When one machine's agent fails, the others are stopped (SIGTERM, then SIGKILL after
    ``grace_s``; an ssh session's end stops its remote side) and its exit status is returned,
    naming the host, its resource-file line and the cause; 0 when all succeed.
    """
    if len(executors) != len(spec.machines):
        raise ArgumentError(f"{len(executors)} executors for {len(spec.machines)} machines")
    extra = dict(env or {})
    machines: list[_Machine] = []
    # Ctrl-C / SIGTERM set a flag the wait loop reads, rather than raising wherever the main
    # thread is: a KeyboardInterrupt inside Popen.poll() can leave its wait lock held, and
    # stopping the machines would then block forever on proc.wait().
    signals: list[int] = []
    previous = _catch_signals(signals)
    try:
        for index, executor in enumerate(executors):
            argv = [sys.executable, "-m", "parallax.cli", "run", "--resources", spec_file,
                    "--machine-index", str(index), "--master-addr", spec.machines[0].host,
                    "--master-port", str(master_port), *cmd]
            machine = spec.machines[index]
            line = f", {spec_file} line {machine.line}" if machine.line else ""
            proc = subprocess.Popen(executor.command(argv, extra),
                                    env={**os.environ, **extra}, start_new_session=True,
                                    stdin=subprocess.PIPE, stderr=subprocess.PIPE)
            record = _Machine(index, f"host {machine.host}{line}", proc,
                              over_ssh=isinstance(executor, SshExecutor))
            record.reader = threading.Thread(target=record.relay_stderr, daemon=True)
            record.reader.start()
            machines.append(record)
        return _wait_all(machines, signals)
    finally:
        _stop([m.proc for m in machines], grace_s)
        for signum, handler in previous.items():
            signal.signal(signum, handler)


#: what signal.signal takes and returns
Handler: TypeAlias = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


def _catch_signals(caught: list[int]) -> dict[int, Handler]:
    """Record SIGINT and SIGTERM in ``caught`` (main thread only: elsewhere Python cannot set
    handlers); returns the handlers to put back."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous: dict[int, Handler] = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        previous[signum] = signal.signal(signum, lambda number, _frame: caught.append(number))
    return previous


def _wait_all(machines: list[_Machine], signals: list[int]) -> int:
    """Wait until every machine succeeds (0), one fails (its status) or a signal came
    (128 + its number; the caller stops the machines)."""
    while True:
        if signals:
            name = signal.Signals(signals[0]).name
            print(f"parallax: {name} received; stopping every machine", file=sys.stderr)
            return 128 + signals[0]
        codes = [m.proc.poll() for m in machines]
        failed = [(m, c) for m, c in zip(machines, codes, strict=True) if c not in (None, 0)]
        if failed:
            machine, code = failed[0]
            if machine.reader is not None:
                machine.reader.join(timeout=2)  # its last lines
            print(f"parallax: machine {machine.index} ({machine.where}) failed: "
                  f"{machine.describe_exit(code)}: {machine.cause()}; stopping the others",
                  file=sys.stderr)
            return code
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.1)


def _stop(procs: list[subprocess.Popen[bytes]], grace_s: float) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
