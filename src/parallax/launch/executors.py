"""Where a machine's processes start: here, inside a network namespace, or over ssh.

An executor turns a command into the command that runs it on one machine. `launch_machines`
starts one torch elastic agent per machine through its executor (``parallax run
--machine-index I``), so the same launcher serves a real cluster over ssh and an emulated one
in namespaces, and stops them all when one fails.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from parallax.cluster import ResourceSpec
from parallax.launch.netem import netns_exec


def omp_threads(workers: int) -> str:
    """``OMP_NUM_THREADS`` for ``workers`` processes sharing this host's cores: the user's own
    setting when there is one, else the cores shared out evenly (at least one each).

    Without it each worker sizes its OpenMP pool for the whole host, and the oversubscribed
    threads spin against each other (3-5x slower steps, measured)."""
    return os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // workers))


class LocalExecutor:
    """Run on this host, as is."""

    def command(self, argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
        return [*argv]


@dataclass
class NamespaceExecutor:
    """Run inside a network namespace of this host (an emulated machine)."""

    namespace: str

    def command(self, argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
        return [*netns_exec(self.namespace), *argv]


@dataclass
class SshExecutor:
    """Run on another host over ssh, in ``workdir`` (which must hold the same files)."""

    host: str
    workdir: str = field(default_factory=os.getcwd)
    ssh: tuple[str, ...] = ("ssh", "-o", "BatchMode=yes")

    def command(self, argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
        # ssh passes one string to the remote shell: quote every piece of it.
        assignments = [f"{key}={shlex.quote(value)}" for key, value in env.items()]
        remote = " ".join(["cd", shlex.quote(self.workdir), "&&", "env", *assignments,
                           shlex.join(argv)])
        return [*self.ssh, self.host, remote]


Executor = LocalExecutor | NamespaceExecutor | SshExecutor


def launch_machines(spec_file: str, spec: ResourceSpec, cmd: Sequence[str],
                    executors: Sequence[Executor], *, master_port: int,
                    env: Mapping[str, str] | None = None, grace_s: float = 10.0) -> int:
    """Start ``parallax run --machine-index I`` on every machine through its executor and wait.

    When one machine's agent fails, the others are stopped (SIGTERM, then SIGKILL after
    ``grace_s``) and its exit status is returned; 0 when all succeed.
    """
    if len(executors) != len(spec.machines):
        raise ValueError(f"{len(executors)} executors for {len(spec.machines)} machines")
    extra = dict(env or {})
    procs = []
    for index, executor in enumerate(executors):
        argv = [sys.executable, "-m", "parallax.cli", "run", "--resources", spec_file,
                "--machine-index", str(index), "--master-addr", spec.machines[0].host,
                "--master-port", str(master_port), *cmd]
        procs.append(subprocess.Popen(executor.command(argv, extra), env={**os.environ, **extra},
                                      start_new_session=True))
    try:
        return _wait_all(procs, grace_s)
    finally:
        _stop(procs, grace_s)


def _wait_all(procs: list[subprocess.Popen], grace_s: float) -> int:
    while True:
        codes = [p.poll() for p in procs]
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            index, code = failed[0]
            print(f"parallax: machine {index} failed (exit status {code}); stopping the "
                  f"others", file=sys.stderr)
            return code
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.1)


def _stop(procs: list[subprocess.Popen], grace_s: float) -> None:
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
