"""The cluster schedulers users already have: SLURM and Kubernetes.

**SLURM.** ``srun --nodes=N --ntasks-per-node=1 parallax run --slurm --nproc-per-machine K
train.py`` runs one agent per node: `slurm_launch` reads the job's node list
(``SLURM_JOB_NODELIST``, expanded as ``scontrol show hostnames`` would: `expand_hostlist`),
this node's index (``SLURM_NODEID``) and, unless given, the workers per node
(``SLURM_GPUS_ON_NODE``, else ``--nproc-per-machine``, else 1); the first node hosts the
rendezvous, on a port derived from the job id so that two jobs sharing a node do not collide.

**Kubernetes.** `pytorchjob_manifest` writes a Kubeflow ``PyTorchJob`` whose containers run
``torchrun --nproc-per-node K train.py``: the training operator sets the ``PET_NNODES``,
``PET_NODE_RANK``, ``PET_MASTER_ADDR`` and ``PET_MASTER_PORT`` variables torchrun reads, and
parallax joins torchrun's launch (machines = pods). ``parallax manifest`` prints it (JSON,
which ``kubectl apply -f`` takes like YAML).
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from parallax.cluster import Machine, ResourceSpec
from parallax.errors import ArgumentError, ResourceError

__all__ = ["SlurmJob", "expand_hostlist", "pytorchjob_manifest", "slurm_job"]

_BRACKET = re.compile(r"\[([^\]]*)\]")


def expand_hostlist(text: str) -> list[str]:
    """SLURM's compressed host list as host names: ``node[01-03,07],gpu5`` ->
    ``node01 node02 node03 node07 gpu5`` (zero padding kept; several bracket groups in one
    name expand as a product, ``r[1-2]n[1-2]`` -> ``r1n1 r1n2 r2n1 r2n2``)."""
    hosts: list[str] = []
    for item in _split_top_level(text.strip()):
        hosts.extend(_expand_one(item))
    if not hosts:
        raise ResourceError(f"empty SLURM host list {text!r}")
    return hosts


def _split_top_level(text: str) -> list[str]:
    """Split at commas outside brackets."""
    items, depth, current = [], 0, ""
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ResourceError(f"unbalanced ']' in SLURM host list {text!r}")
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    if depth:
        raise ResourceError(f"unbalanced '[' in SLURM host list {text!r}")
    return [item for item in [*items, current] if item]


def _expand_one(name: str) -> list[str]:
    match = _BRACKET.search(name)
    if match is None:
        return [name]
    head, tail = name[:match.start()], name[match.end():]
    values = []
    for part in match.group(1).split(","):
        low, sep, high = part.partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise ResourceError(f"bad range {part!r} in SLURM host name {name!r}")
        width = len(low)
        stop = int(high) if sep else int(low)
        if stop < int(low):
            raise ResourceError(f"descending range {part!r} in SLURM host name {name!r}")
        values += [str(number).zfill(width) for number in range(int(low), stop + 1)]
    return [f"{head}{value}{rest}" for value in values for rest in _expand_one(tail)]


@dataclass(frozen=True)
class SlurmJob:
    """This node's part of a SLURM job: the job's machines, its index, the rendezvous."""

    spec: ResourceSpec
    machine_index: int
    master_addr: str
    master_port: int


def slurm_job(env: Mapping[str, str], *, nproc_per_machine: int | None = None,
              master_port: int | None = None) -> SlurmJob:
    """Read the job from SLURM's variables (``env``: os.environ under ``srun``); raises
    `ResourceError` naming the variable that is missing or wrong."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise ResourceError("--slurm: SLURM_JOB_NODELIST is not set: run parallax under srun "
                            "(srun --ntasks-per-node=1 parallax run --slurm ...)")
    hosts = expand_hostlist(nodelist)
    node = env.get("SLURM_NODEID")
    if node is None or not node.isdigit() or int(node) >= len(hosts):
        raise ResourceError(f"--slurm: SLURM_NODEID={node!r} is not an index into the "
                            f"{len(hosts)} node(s) of SLURM_JOB_NODELIST={nodelist!r}")
    tasks = env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0]
    if tasks not in ("", "1"):
        raise ResourceError(f"--slurm: SLURM_NTASKS_PER_NODE={tasks}: run one parallax agent "
                            "per node (srun --ntasks-per-node=1); it starts the node's workers")
    workers = nproc_per_machine or int(env.get("SLURM_GPUS_ON_NODE") or 1)
    devices = tuple(range(workers)) if workers > 1 or env.get("SLURM_GPUS_ON_NODE") else ()
    spec = ResourceSpec(tuple(Machine(host, devices) for host in hosts))
    job_id = env.get("SLURM_JOB_ID", "0")
    port = master_port or 20000 + zlib.crc32(job_id.encode()) % 20000
    return SlurmJob(spec, int(node), hosts[0], port)


def pytorchjob_manifest(name: str, image: str, *, nodes: int, nproc_per_node: int,
                        command: Sequence[str], gpus_per_node: int = 0,
                        env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A Kubeflow training-operator ``PyTorchJob`` (kubeflow.org/v1) running ``command``
    (the script and its arguments) under ``torchrun --nproc-per-node nproc_per_node`` on
    ``nodes`` pods of ``image``: one Master, ``nodes - 1`` Workers."""
    if nodes < 1 or nproc_per_node < 1:
        raise ArgumentError("nodes and nproc_per_node must be at least 1")
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name):
        raise ArgumentError(f"job name {name!r} is not a Kubernetes name (lower case, digits, -)")
    container: dict[str, Any] = {
        "name": "pytorch",  # the container name the operator looks for
        "image": image,
        # torchrun reads PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR and PET_MASTER_PORT,
        # which the operator sets in every pod
        "command": ["torchrun", f"--nproc-per-node={nproc_per_node}", *command],
        "env": [{"name": k, "value": v} for k, v in (env or {}).items()],
    }
    if gpus_per_node:
        container["resources"] = {"limits": {"nvidia.com/gpu": gpus_per_node}}
    template = {"spec": {"containers": [container]}}
    replicas = {"Master": {"replicas": 1, "restartPolicy": "OnFailure", "template": template}}
    if nodes > 1:
        replicas["Worker"] = {"replicas": nodes - 1, "restartPolicy": "OnFailure",
                              "template": template}
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
            "metadata": {"name": name},
            "spec": {"nprocPerNode": str(nproc_per_node), "pytorchReplicaSpecs": replicas}}
