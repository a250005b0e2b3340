"""One command starts every host: ``parallax run --resources FILE`` over real ssh.

Two machines of the emulated cluster (network namespaces) each run Debian's ``sshd`` with a
throwaway host key and an ``AuthorizedKeysFile`` in a temporary folder (the machine's own
``~/.ssh`` is never read or written); the launcher, in the root namespace, reaches them over
the bridge as it would reach real hosts. A 2x2 job launched over ssh equals the local launch;
an unreachable host, a refused key and a remote Python without parallax each fail with the
host and its resource-file line named, and leave nothing running.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from parallax.launch.netem import EmulatedNetwork, NetemError

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "scripts" / "equivalence_worker.py"
CASE = "=hybrid-mixed-adam-densegrad-clip0.05-float64"  # one case of the matrix, exactly
SSHD = shutil.which("sshd") or ("/usr/sbin/sshd" if os.path.exists("/usr/sbin/sshd") else None)


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "tc", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    if SSHD is None:
        return "needs sshd (apt-get install openssh-server; .ci/run installs it)"
    return None


# the launcher's default start (torchrun's: each worker a fresh interpreter): the tests find
# the workers by their command lines
pytestmark = [pytest.mark.skipif(_why_not() is not None, reason=str(_why_not())),
              pytest.mark.start_method("exec")]


@dataclass
class SshCluster:
    net: EmulatedNetwork
    folder: Path
    identity: Path
    wrong_identity: Path
    daemons: list[subprocess.Popen]

    def resources(self, hosts: list[str], name: str = "resources.txt") -> Path:
        path = self.folder / name
        path.write_text("# two machines, two workers each\n"
                        + "".join(f"{host}:0,1\n" for host in hosts))
        return path

    def run(self, resources: Path, out: Path, *, identity: Path | None = None,
            python: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "parallax.cli", "run", "--resources", str(resources),
               "--ssh-identity", str(identity or self.identity),
               "--ssh-option", f"UserKnownHostsFile={self.folder / 'known_hosts'}",
               "--ssh-option", "StrictHostKeyChecking=no",
               "--ssh-option", "ConnectTimeout=3", "--ssh-option", "LogLevel=ERROR",
               # namespaces resolve no host names: gloo's interface, c10d's warning
               "--env", "GLOO_SOCKET_IFNAME=eth0", "--env", "TORCH_CPP_LOG_LEVEL=ERROR",
               "--env", "OMP_NUM_THREADS=1",
               *(["--remote-python", python] if python else []),
               "--master-port", "29611", str(WORKER), str(out), CASE]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def _keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)],
                   check=True)


def _wait_listening(address: str, port: int = 22, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            sock.settimeout(0.5)
            if sock.connect_ex((address, port)) == 0:
                return
        time.sleep(0.1)
    raise AssertionError(f"sshd on {address}:{port} did not answer within {timeout} s")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[SshCluster]:
    folder = tmp_path_factory.mktemp("ssh")
    for key in ("host_key", "id", "wrong_id"):
        _keygen(folder / key)
    (folder / "authorized_keys").write_text((folder / "id.pub").read_text())
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
    try:
        net = EmulatedNetwork(2, "1gbit")
        net.setup()
    except NetemError as err:
        pytest.skip(f"no emulated network here: {err}")
    daemons = []
    try:
        net.reach_from_host()
        for machine in range(2):
            config = folder / f"sshd_config-{machine}"
            config.write_text(
                f"ListenAddress {net.address(machine)}\nPort 22\n"
                f"HostKey {folder / 'host_key'}\nAuthorizedKeysFile {folder / 'authorized_keys'}\n"
                f"PidFile {folder / f'sshd-{machine}.pid'}\nPasswordAuthentication no\n"
                "KbdInteractiveAuthentication no\nUsePAM no\nPermitRootLogin prohibit-password\n"
                "StrictModes no\nAcceptEnv none\n")
            daemons.append(subprocess.Popen([*net.exec_prefix(machine), SSHD, "-D", "-e",
                                             "-f", str(config)], stderr=subprocess.DEVNULL))
        for machine in range(2):
            _wait_listening(net.address(machine))
        yield SshCluster(net, folder, folder / "id", folder / "wrong_id", daemons)
    finally:
        for daemon in daemons:
            daemon.terminate()
            daemon.wait(timeout=10)
        net.teardown()
    # cleanup: no sshd of ours, no namespace, and the keys go with the folder
    assert not _processes_mentioning(str(folder))
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert net.namespace(0) not in listed and net.namespace(1) not in listed
    shutil.rmtree(folder)
    assert not folder.exists()


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            command = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in command and str(os.getpid()) != cmdline.parent.name:
            found.append(command)
    return found


def _assert_nothing_left(out: Path) -> None:
    """No agent or worker of the run (their command lines name its output file) survives."""
    deadline = time.monotonic() + 15
    while _processes_mentioning(str(out)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _processes_mentioning(str(out)), _processes_mentioning(str(out))


def test_a_job_over_ssh_equals_the_local_launch(cluster: SshCluster, tmp_path: Path) -> None:
    hosts = [cluster.net.address(0), cluster.net.address(1)]
    proc = cluster.run(cluster.resources(hosts), tmp_path / "ssh.pt")
    assert proc.returncode == 0, proc.stderr[-4000:]
    local = subprocess.run([sys.executable, "-m", "parallax.cli", "run", "--machines", "2",
                            "--nproc-per-machine", "2", str(WORKER), str(tmp_path / "local.pt"),
                            CASE], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert local.returncode == 0, local.stderr[-4000:]
    over_ssh, here = torch.load(tmp_path / "ssh.pt"), torch.load(tmp_path / "local.pt")
    assert over_ssh.keys() == here.keys() == {CASE[1:]}
    for name, value in here[CASE[1:]].items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(over_ssh[CASE[1:]][name], value, rtol=1e-12, atol=0)
    _assert_nothing_left(tmp_path / "ssh.pt")


@pytest.mark.parametrize("failure", ["unreachable host", "refused key", "no parallax there"])
def test_a_failing_host_is_named_and_nothing_is_left(cluster: SshCluster, tmp_path: Path,
                                                     failure: str) -> None:
    hosts = [cluster.net.address(0), cluster.net.address(1)]
    options = {}
    if failure == "unreachable host":
        hosts[1] = f"{cluster.net.address(1).rsplit('.', 1)[0]}.77"  # no machine there
    elif failure == "refused key":
        options["identity"] = cluster.wrong_identity
    else:
        options["python"] = sys._base_executable  # this Python without the venv: no parallax
    resources = cluster.resources(hosts, f"{failure.replace(' ', '-')}.txt")
    out = tmp_path / "out.pt"
    start = time.monotonic()
    proc = cluster.run(resources, out, **options)
    assert proc.returncode != 0
    assert time.monotonic() - start < 120
    summary = [line for line in proc.stderr.splitlines()
               if line.startswith("parallax: machine") and "failed" in line]
    assert summary, proc.stderr[-3000:]
    expected = {"unreachable host": ("1", hosts[1], 3, "ssh: connect to host"),
                "refused key": (None, None, None, "Permission denied"),
                "no parallax there": (None, None, None, "No module named")}[failure]
    machine, host, line, cause = expected
    if machine is not None:
        assert f"machine {machine} (host {host}, {resources} line {line})" in summary[0], summary
    else:
        assert f"{resources} line" in summary[0], summary
    assert cause in summary[0], summary
    _assert_nothing_left(out)


def test_ctrl_c_stops_every_host(cluster: SshCluster, tmp_path: Path) -> None:
    """SIGINT to the launcher while every host's workers run: the ssh sessions end, each
    host's guard stops its agent and workers, nothing is left."""
    script = tmp_path / "sleeper.py"
    script.write_text("import time\ntime.sleep(300)\n")
    marker = tmp_path / "marker"
    resources = cluster.resources([cluster.net.address(0), cluster.net.address(1)],
                                  "sleepers.txt")
    cmd = [sys.executable, "-m", "parallax.cli", "run", "--resources", str(resources),
           "--ssh-identity", str(cluster.identity),
           "--ssh-option", f"UserKnownHostsFile={cluster.folder / 'known_hosts'}",
           "--ssh-option", "StrictHostKeyChecking=no", "--ssh-option", "LogLevel=ERROR",
           "--env", "GLOO_SOCKET_IFNAME=eth0", "--env", "TORCH_CPP_LOG_LEVEL=ERROR",
           "--master-port", "29612", str(script), str(marker)]
    launcher = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # both hosts' two workers are up
            workers = [c for c in _processes_mentioning(str(marker)) if "sleeper.py" in c
                       and "parallax.cli" not in c and "guard" not in c]
            if len(workers) == 4:
                break
            time.sleep(0.2)
        assert len(workers) == 4, workers
        launcher.send_signal(signal.SIGINT)
        launcher.wait(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    # the signal is caught (not raised mid-call) and reported as a shell reports it
    assert launcher.returncode == 128 + signal.SIGINT, launcher.stderr.read()[-2000:]
    _assert_nothing_left(marker)
