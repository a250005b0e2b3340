"""Cluster resources, the identity of the current worker, and the environment that carries it.

A resource file lists one machine per line as ``host`` or ``host:dev,dev,...``.  A machine
runs one worker per listed device (one worker when no devices are listed), and ranks are laid
out machine by machine: machine 0's workers first, then machine 1's, and so on.  One
parameter server per machine is co-located with the machine's first worker.
"""

from __future__ import annotations

import json
import os
import re
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from parallax.errors import ArgumentError, ResourceError

if TYPE_CHECKING:
    import torch

__all__ = [
    "PLAN_ONLY_ENV",
    "PLAN_WARMUP_ENV",
    "TIMELINE_ENV",
    "LaunchOrders",
    "RESOURCES_ENV",
    "SHARED_GPU_ENV",
    "EnvironmentPatch",
    "Machine",
    "ResourceError",
    "ResourceSpec",
    "WorkerInfo",
    "is_local_host",
    "current_worker",
    "local_spec",
    "parse_resource_text",
    "shares_gpus",
    "parse_resources",
]

#: Environment variable through which the launcher hands the spec (as JSON) to its workers.
RESOURCES_ENV = "PARALLAX_RESOURCES"
#: Set by ``parallax plan``: workers stop after the warm-up steps, rank 0 prints the plan and
#: writes its JSON to this path (if not empty).
PLAN_ONLY_ENV = "PARALLAX_PLAN_ONLY"
#: Set by ``parallax plan``: how many warm-up steps measure α.
PLAN_WARMUP_ENV = "PARALLAX_PLAN_WARMUP_STEPS"
#: Set by ``parallax run --timeline FILE``: where each rank writes its phases' trace.
TIMELINE_ENV = "PARALLAX_TIMELINE"

_HOST_RE = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?")
_IPV6_RE = re.compile(r"[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*")
_LOCAL_NAMES = frozenset({"localhost", "localhost.localdomain", "::1"})


@dataclass(frozen=True)
class Machine:
    """One machine: its host name and the device indices its workers use."""

    host: str
    devices: tuple[int, ...] = ()
    line: int = field(default=0, compare=False)  # in its resource file (0: not from a file)

    @property
    def num_workers(self) -> int:
        """One worker per device, or a single worker when no devices are listed."""
        return max(1, len(self.devices))

    def device_of(self, local_rank: int) -> int | None:
        """Device index of the worker with this local rank, None when none was listed."""
        return self.devices[local_rank] if self.devices else None


@dataclass(frozen=True)
class ResourceSpec:
    """The machines of a job, in rank order."""

    machines: tuple[Machine, ...]

    def __post_init__(self) -> None:
        if not self.machines:
            raise ResourceError("a resource spec needs at least one machine")

    @property
    def world_size(self) -> int:
        """Total number of workers over all machines."""
        return sum(m.num_workers for m in self.machines)

    @cached_property
    def machine_of_rank(self) -> tuple[int, ...]:
        """Machine index of every rank; ranks are laid out machine by machine."""
        return tuple(i for i, m in enumerate(self.machines) for _ in range(m.num_workers))

    def first_rank(self, machine: int) -> int:
        """Global rank of the first worker (the server's host) of ``machine``."""
        if not 0 <= machine < len(self.machines):
            raise ResourceError(f"machine {machine} out of range 0..{len(self.machines) - 1}")
        return sum(m.num_workers for m in self.machines[:machine])

    def device_of_rank(self, rank: int) -> int | None:
        """Device index the spec assigns to ``rank``, None when its machine lists none."""
        machine = self.machine_of_rank[rank]
        return self.machines[machine].device_of(rank - self.first_rank(machine))

    def is_local(self) -> bool:
        """True when every machine is this host, i.e. the cluster is emulated locally."""
        return all(is_local_host(m.host) for m in self.machines)

    def to_json(self) -> str:
        """Serialise compactly, e.g. to hand the spec to workers through the environment."""
        machines = [{"host": m.host, "devices": list(m.devices), "line": m.line}
                    for m in self.machines]
        return json.dumps({"machines": machines}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> ResourceSpec:
        """Inverse of :meth:`to_json`."""
        data = json.loads(text)
        return cls(
            tuple(Machine(m["host"], tuple(int(d) for d in m["devices"]), int(m.get("line", 0)))
                  for m in data["machines"])
        )


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def is_local_host(host: str) -> bool:
    """Whether ``host`` names this machine (loopback names or our own host name)."""
    if host in _LOCAL_NAMES or host.startswith("127."):
        return True
    own = socket.gethostname()
    return host in (own, own.split(".")[0])


def parse_resources(path: str | os.PathLike[str]) -> ResourceSpec:
    """Parse a resource file; errors name the file and line."""
    return parse_resource_text(Path(path).read_text(), source=str(path))


def parse_resource_text(text: str, source: str = "<string>") -> ResourceSpec:
    """Parse resource-file text; ``source`` names it in error messages."""
    machines = []
    # Only newlines end lines: str.splitlines() would also split at form feeds and other
    # separators, turning the rest of a comment into a machine line.
    for lineno, raw in enumerate(text.replace("\r\n", "\n").split("\n"), start=1):
        body = raw.split("#", 1)[0].strip()
        if not body:
            continue
        try:
            machines.append(replace(_parse_line(body), line=lineno))
        except _LineError as err:
            raise ResourceError(f"{source}:{lineno}: {err}: {raw.strip()}") from None
    if not machines:
        raise ResourceError(f"{source}:1: empty resource file: no machine lines")
    return ResourceSpec(tuple(machines))


class _LineError(Exception):
    """Reason one line is malformed; turned into a ResourceError with file and line."""


def _parse_line(body: str) -> Machine:
    """Parse ``host``, ``host:devs``, ``[v6]`` or ``[v6]:devs`` (comment already removed)."""
    host, devices = _split_host(body)
    if devices is None:
        return Machine(host)
    return Machine(host, _parse_devices(devices))


def _split_host(body: str) -> tuple[str, str | None]:
    """Split a line into host and the device list text (None when there is none)."""
    if body.startswith("["):
        host, sep, rest = body[1:].partition("]")
        if not sep or not _IPV6_RE.fullmatch(host):
            raise _LineError("bad host")
        if rest and not rest.startswith(":"):
            raise _LineError("bad host")
        return host, rest[1:] if rest else None
    host, sep, devices = body.partition(":")
    host = host.strip()
    if not _HOST_RE.fullmatch(host):
        raise _LineError(f"bad host {host!r}" if host else "missing host")
    return host, devices if sep else None


def _parse_devices(text: str) -> tuple[int, ...]:
    """Parse ``0,1,...``: non-negative integers without duplicates."""
    devices: list[int] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            raise _LineError("empty device")
        if not item.isdecimal() or not item.isascii():
            raise _LineError(f"device {item!r} is not a non-negative integer")
        if int(item) in devices:
            raise _LineError(f"duplicate device {int(item)}")
        devices.append(int(item))
    return tuple(devices)


def local_spec(machines: int, nproc_per_machine: int) -> ResourceSpec:
    """Emulate ``machines`` machines on this host, each with devices 0..nproc_per_machine-1."""
    if machines < 1 or nproc_per_machine < 1:
        raise ArgumentError("machines and nproc_per_machine must both be at least 1")
    machine = Machine("localhost", tuple(range(nproc_per_machine)))
    return ResourceSpec((machine,) * machines)


@dataclass(frozen=True)
class WorkerInfo:
    """Where the current process sits in the job: rank, machine and device."""

    rank: int
    world_size: int
    local_rank: int
    machine: int
    num_machines: int
    machine_of_rank: tuple[int, ...]
    device_index: int | None = None

    @property
    def server_ranks(self) -> tuple[int, ...]:
        """First rank of each machine: the ranks that host a parameter server."""
        firsts: dict[int, int] = {}
        for rank, machine in enumerate(self.machine_of_rank):
            firsts.setdefault(machine, rank)
        return tuple(firsts[m] for m in sorted(firsts))

    @property
    def is_server(self) -> bool:
        """Whether this rank hosts its machine's parameter server."""
        return self.rank in self.server_ranks

    @property
    def device(self) -> torch.device:
        """The spec's CUDA device for this worker when CUDA is usable, else the CPU. A GPU
        index this host does not have is refused here, naming the rank (CUDA and NCCL would
        fail later, naming neither)."""
        import torch

        if self.device_index is None or not torch.cuda.is_available():
            return torch.device("cpu")
        count = torch.cuda.device_count()
        if self.device_index >= count and shares_gpus():
            return torch.device("cuda", self.device_index % count)
        if self.device_index >= count:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            raise ResourceError(
                f"rank {self.rank} (machine {self.machine}, local rank {self.local_rank}) is "
                f"given GPU {self.device_index}, but this host has {count} visible GPU(s)"
                + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else "")
                + ": give each worker a GPU of its own (NCCL refuses two ranks on one GPU; "
                "fewer workers per machine, or list existing devices in the resource file), "
                "or hide the GPUs (CUDA_VISIBLE_DEVICES=) to train on the CPU; to only "
                f"check a multi-rank program on fewer GPUs, {SHARED_GPU_ENV}=1 (slow)")
        return torch.device("cuda", self.device_index)

    @property
    def backend(self) -> str:
        """The process groups' backend: NCCL for a CUDA worker, gloo on the CPU and where ranks
        share GPUs (`shares_gpus`: NCCL refuses two ranks on one GPU; gloo moves CUDA tensors
        through host memory)."""
        return "nccl" if self.device.type == "cuda" and not shares_gpus() else "gloo"


#: ``PARALLAX_SHARED_GPU=1``: ranks beyond the host's GPUs share them (see `shares_gpus`)
SHARED_GPU_ENV = "PARALLAX_SHARED_GPU"


def shares_gpus() -> bool:
    """Whether ranks may share GPUs (``PARALLAX_SHARED_GPU=1``): rank ``r`` of a machine then
    trains on GPU ``r % count`` and every process group is gloo. For checking the multi-rank
    CUDA paths (uneven exchanges, replicated tables, asynchronous servers) on a host with
    fewer GPUs than ranks (`scripts/gpu_check.sh` on one GPU); slow: not for training."""
    return os.environ.get(SHARED_GPU_ENV, "") not in ("", "0")


def current_worker() -> WorkerInfo | None:
    """Identity of this process in a distributed launch, None outside one."""
    env = os.environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
    if RESOURCES_ENV in env:
        return _worker_from_spec(ResourceSpec.from_json(env[RESOURCES_ENV]), rank, world_size)
    return _worker_from_torchrun(env, rank, world_size)


def _worker_from_spec(spec: ResourceSpec, rank: int, world_size: int) -> WorkerInfo:
    """Identity from our launcher's spec, which knows each machine's worker count."""
    if spec.world_size != world_size:
        raise ResourceError(
            f"{RESOURCES_ENV} describes {spec.world_size} workers but WORLD_SIZE={world_size}"
        )
    machine = spec.machine_of_rank[rank]
    return WorkerInfo(
        rank=rank,
        world_size=world_size,
        local_rank=rank - spec.first_rank(machine),
        machine=machine,
        num_machines=len(spec.machines),
        machine_of_rank=spec.machine_of_rank,
        device_index=spec.device_of_rank(rank),
    )


def _worker_from_torchrun(env: Mapping[str, str], rank: int, world_size: int) -> WorkerInfo:
    """Identity under plain ``torchrun``: one node per machine, equal workers per node, and
    (torchrun's convention) GPU ``LOCAL_RANK`` for each worker where CUDA is usable."""
    local_world = int(env.get("LOCAL_WORLD_SIZE", world_size))
    local_rank = int(env.get("LOCAL_RANK", rank % local_world))
    return WorkerInfo(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        machine=int(env.get("GROUP_RANK", rank // local_world)),
        num_machines=world_size // local_world,
        machine_of_rank=tuple(r // local_world for r in range(world_size)),
        device_index=local_rank,
    )


@dataclass(frozen=True)
class LaunchOrders:
    """What the ``parallax`` command asked of this worker beyond training (read once, by the
    runner): ``plan_only`` (``parallax plan``: stop after the warm-up and write the plan here,
    "" to print it only), ``warmup_steps`` (``parallax plan --warmup-steps``) and
    ``timeline`` (``parallax run --timeline``: this rank's trace file)."""

    plan_only: str | None = None
    warmup_steps: int | None = None
    timeline: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> LaunchOrders:
        warmup = env.get(PLAN_WARMUP_ENV)
        return cls(plan_only=env.get(PLAN_ONLY_ENV),
                   warmup_steps=int(warmup) if warmup is not None else None,
                   timeline=env.get(TIMELINE_ENV) or None)


class EnvironmentPatch:
    """Set variables in ``os.environ`` (which child processes and `current_worker` read), and
    later put back what they were, unsetting those that were unset.

    As a context manager, ``with EnvironmentPatch(updates):`` sets ``updates`` on entry and
    restores on exit. A patch that outlives one call (a one-worker run's identity, set now and
    undone at shutdown) calls `set` as often as needed, then `restore` once: a variable's first
    saved value is the one put back. ``restoring`` names variables to put back that others
    (torch's elastic agent) may set meanwhile.
    """

    def __init__(self, updates: Mapping[str, str] | None = None, *,
                 restoring: Iterable[str] = ()) -> None:
        self._updates = dict(updates or {})
        self._restoring = tuple(restoring)
        self._saved: dict[str, str | None] = {}

    def set(self, updates: Mapping[str, str], *, restoring: Iterable[str] = ()) -> None:
        """Set ``updates``, first saving the value of each (and of each in ``restoring``) that
        this patch has not saved yet."""
        for key in [*updates, *restoring]:
            self._saved.setdefault(key, os.environ.get(key))
        os.environ.update(updates)

    def restore(self) -> None:
        """Put back every saved variable as it was; the patch is then empty."""
        for key, value in self._saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._saved.clear()

    def __enter__(self) -> EnvironmentPatch:
        self.set(self._updates, restoring=self._restoring)
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()
