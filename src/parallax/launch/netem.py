"""An emulated cluster on one host: each "machine" a Linux network namespace on a bridge.

Every machine gets a veth pair: ``eth0`` inside its namespace (address ``10.77.<net>.<i+1>``),
the other end on a bridge in the root namespace. Both ends are rate-limited with ``tc tbf``
(uplink and downlink), so traffic between machines crosses a link of known bandwidth while the
processes of one machine talk over their own loopback, and the host ends' byte counters are the
true bytes on the wire per machine. No delay or loss emulation (this kernel has no netem).

Names carry a per-run id; a state file per run (``/run/parallax-netem/<id>``) records the
owning PID, so a run that crashed is cleaned up by the next one, and every run removes its own
namespaces and bridge on exit. Runs may overlap (two test processes, a benchmark beside a
test): each claims its subnet by a file of its own (``net-<octet>``), so no two live runs share
one. Needs root, ``ip`` and ``tc`` (Debian's iproute2).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from parallax.atomic import create_text, replace_text
from parallax.errors import ArgumentError, NetemError

OFFLINE_ENV = "PARALLAX_OFFLINE"
"""Set to ``"1"`` for the workers of an emulated cluster, whose namespaces reach only each
other: code that would download (the demo corpora) must fail at once and say what to fetch
beforehand. ``""`` or ``"0"`` means online."""

STATE_DIR = Path(os.environ.get("PARALLAX_NETEM_STATE", "/run/parallax-netem"))
SUBNET = "10.77"
SUBNETS = 250  # third octets 1..250 (.254 of each is the host's: `reach_from_host`)
SUBNET_CLAIM = "net-"  # STATE_DIR/net-<octet>: "pid run_id" of the run using that subnet


@dataclass
class LinkCounters:
    """Bytes a machine sent and received over its link."""

    sent: int
    received: int


@dataclass
class EmulatedNetwork:
    """``machines`` namespaces on one bridge, each link limited to ``rate`` (tc syntax, e.g.
    ``"1gbit"``, ``"100mbit"``). Use as a context manager."""

    machines: int
    rate: str = "1gbit"
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    _created: bool = False

    def __post_init__(self) -> None:
        if self.machines < 1:
            raise ArgumentError(f"machines must be >= 1, got {self.machines}")
        # third octet of this run's subnet: a first choice here, claimed at setup (another
        # live run may hold it)
        self.net = int(self.run_id, 16) % SUBNETS + 1

    # ---- names -----------------------------------------------------------------------------
    def namespace(self, machine: int) -> str:
        return f"px{self.run_id}m{machine}"

    def host_link(self, machine: int) -> str:
        return f"px{self.run_id}v{machine}"  # <= 15 characters, the kernel's limit

    @property
    def bridge(self) -> str:
        return f"px{self.run_id}br"

    def address(self, machine: int) -> str:
        return f"{SUBNET}.{self.net}.{machine + 1}"

    # ---- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> EmulatedNetwork:
        self.setup()
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def setup(self) -> None:
        check_prerequisites()
        clean_stale_runs()
        # whole or absent: a run cleaning up beside this one must not read it empty
        replace_text(STATE_DIR / self.run_id, str(os.getpid()))
        self._created = True
        try:
            self.net = claim_subnet(self.net, self.run_id)
        except NetemError:
            self.teardown()
            raise
        burst = _burst_bytes(self.rate)
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            for machine in range(self.machines):
                ns, link = self.namespace(machine), self.host_link(machine)
                _ip("netns", "add", ns)
                _ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("link", "set", link, "master", self.bridge)
                _ip("link", "set", link, "up")
                _ip("-n", ns, "addr", "add", f"{self.address(machine)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                for prefix in ([], netns_exec(ns)):
                    device = link if not prefix else "eth0"
                    _run([*prefix, "tc", "qdisc", "add", "dev", device, "root", "tbf", "rate",
                          self.rate, "burst", str(burst), "latency", "50ms"])
        except NetemError:
            self.teardown()
            raise

    def teardown(self) -> None:
        """Remove this run's namespaces (their veths go with them) and bridge; idempotent."""
        if not self._created:
            return
        remove_run(self.run_id)
        self._created = False

    # ---- use -------------------------------------------------------------------------------
    def reach_from_host(self) -> str:
        """Give the bridge an address on the machines' subnet, so that this host (its root
        namespace) reaches them, as a launcher on a real cluster reaches its hosts; returns
        it. Gone with the bridge at teardown."""
        address = f"{SUBNET}.{self.net}.254"
        _ip("addr", "add", f"{address}/24", "dev", self.bridge)
        return address

    def exec_prefix(self, machine: int) -> list[str]:
        """Command prefix that runs a program inside ``machine``'s namespace."""
        return netns_exec(self.namespace(machine))

    def counters(self) -> list[LinkCounters]:
        """Bytes each machine sent and received over its link so far (the host end's
        counters: what it transmits the machine received)."""
        result = []
        for machine in range(self.machines):
            stats = Path("/sys/class/net") / self.host_link(machine) / "statistics"
            result.append(LinkCounters(sent=int((stats / "rx_bytes").read_text()),
                                       received=int((stats / "tx_bytes").read_text())))
        return result


def netns_exec(namespace: str) -> list[str]:
    """Command prefix that runs a program inside network namespace ``namespace``."""
    return ["ip", "netns", "exec", namespace]


def check_prerequisites() -> None:
    if os.geteuid() != 0:
        raise NetemError("the emulated network needs root (network namespaces, veth, tc); "
                         "run as root or without --emulate-network")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise NetemError(f"the emulated network needs {' and '.join(missing)}: "
                         f"apt-get install iproute2")


def clean_stale_runs() -> None:
    """Remove what runs whose process is gone left behind (a crash, a SIGKILL)."""
    if not STATE_DIR.exists():
        return
    for state in STATE_DIR.iterdir():
        if state.name.startswith("."):  # a state file being written (`replace_text`)
            continue
        if _owner_alive(state):
            continue
        if state.name.startswith(SUBNET_CLAIM):
            state.unlink(missing_ok=True)
        else:
            remove_run(state.name)


def _owner_alive(state: Path) -> bool:
    """Whether the process whose id ``state`` holds ("pid" or "pid run_id") still runs."""
    try:
        os.kill(int(state.read_text().split()[0]), 0)
    except (ProcessLookupError, ValueError, IndexError):
        return False
    except FileNotFoundError:  # removed meanwhile by its run
        return True
    return True


def claim_subnet(first: int, run_id: str) -> int:
    """A third octet no live run uses, from ``first`` on: each run holds its subnet by a file
    made whole and at once (`parallax.atomic.create_text`), so that runs set up side by side
    (two test processes, two benchmarks) never share a subnet, which would break both."""
    for offset in range(SUBNETS):
        net = (first - 1 + offset) % SUBNETS + 1
        claim = STATE_DIR / f"{SUBNET_CLAIM}{net}"
        for _ in range(2):  # a stale claim is removed once, then tried again
            if create_text(claim, f"{os.getpid()} {run_id}"):
                return net
            if _owner_alive(claim):
                break
            claim.unlink(missing_ok=True)
    raise NetemError(f"every subnet {SUBNET}.1-{SUBNETS}.0/24 is held by a running emulated "
                     f"network (claims in {STATE_DIR}); end some of them")


def remove_run(run_id: str) -> None:
    """Delete a run's namespaces (their veth pairs go with them), bridge, subnet claim and
    state file."""
    namespaces = _list_namespaces(f"px{run_id}m")
    for ns in namespaces:
        _run(["ip", "netns", "del", ns], check=False)
    _run(["ip", "link", "del", f"px{run_id}br"], check=False)
    for claim in STATE_DIR.glob(f"{SUBNET_CLAIM}*") if STATE_DIR.exists() else ():
        try:
            if claim.read_text().split()[1:] == [run_id]:
                claim.unlink(missing_ok=True)
        except (FileNotFoundError, IndexError):
            pass
    (STATE_DIR / run_id).unlink(missing_ok=True)


def _list_namespaces(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


def _burst_bytes(rate: str) -> int:
    """About 2 ms of traffic at ``rate``, at least 64 KiB (what reached ~96 % of the rate)."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    text = rate.strip().lower()
    for unit, scale in units.items():
        if text.endswith(unit):
            try:
                bits = float(text[: -len(unit)]) * scale
            except ValueError:
                break
            return max(64 * 1024, int(bits / 8 * 0.002))
    raise NetemError(f"rate {rate!r} is not a tc rate like '100mbit' or '1gbit'")


def _ip(*args: str) -> None:
    _run(["ip", *args])


def _run(cmd: list[str], check: bool = True) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise NetemError(f"{' '.join(cmd)} failed: {proc.stderr.strip() or proc.returncode}")
