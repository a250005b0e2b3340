"""SLURM and Kubernetes: the commands parallax builds from their variables and manifests, and
each one run for real on this host, two "nodes" side by side, equal to the local launch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from parallax.errors import ResourceError
from parallax.launch.schedulers import expand_hostlist, pytorchjob_manifest, slurm_job

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "scripts" / "equivalence_worker.py"
CASE = "=hybrid-mixed-adam-densegrad-clip0.05-float64"


@pytest.mark.parametrize("text, hosts", [
    ("node1", ["node1"]),
    ("node[1-3]", ["node1", "node2", "node3"]),
    ("gpu[08-10,12],cpu5", ["gpu08", "gpu09", "gpu10", "gpu12", "cpu5"]),
    ("r[1-2]n[1,3]", ["r1n1", "r1n3", "r2n1", "r2n3"]),
    ("a.example.org,b-1", ["a.example.org", "b-1"]),
])
def test_slurm_host_lists_expand_as_scontrol_does(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text, named", [
    ("node[1-3", "unbalanced '\\['"), ("node1-3]", "unbalanced '\\]'"),
    ("node[3-1]", "descending range '3-1'"), ("node[a-b]", "bad range 'a-b'"), ("", "empty"),
])
def test_bad_slurm_host_lists_are_named(text, named):
    with pytest.raises(ResourceError, match=named):
        expand_hostlist(text)


def test_slurm_job_reads_the_nodes_this_node_and_a_stable_port():
    env = {"SLURM_JOB_NODELIST": "gpu[1-2]", "SLURM_NODEID": "1", "SLURM_JOB_ID": "4711",
           "SLURM_GPUS_ON_NODE": "4", "SLURM_NTASKS_PER_NODE": "1"}
    job = slurm_job(env)
    assert [m.host for m in job.spec.machines] == ["gpu1", "gpu2"]
    assert [m.devices for m in job.spec.machines] == [(0, 1, 2, 3)] * 2
    assert (job.machine_index, job.master_addr) == (1, "gpu1")
    assert job.master_port == slurm_job(env).master_port != slurm_job(
        {**env, "SLURM_JOB_ID": "4712"}).master_port  # per job, the same on every node
    assert 20000 <= job.master_port < 40000
    cpu = slurm_job({"SLURM_JOB_NODELIST": "c[1-3]", "SLURM_NODEID": "0"}, nproc_per_machine=2,
                    master_port=1234)
    assert cpu.spec.world_size == 6 and cpu.master_port == 1234


@pytest.mark.parametrize("env, named", [
    ({}, "SLURM_JOB_NODELIST is not set"),
    ({"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NODEID": "2"}, "SLURM_NODEID='2'"),
    ({"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NODEID": "0", "SLURM_NTASKS_PER_NODE": "4"},
     "one parallax agent per node"),
])
def test_a_wrong_slurm_environment_is_named(env, named):
    with pytest.raises(ResourceError, match=named):
        slurm_job(env)


def test_the_pytorchjob_manifest_runs_torchrun_on_every_pod():
    job = pytorchjob_manifest("lm", "registry/lm:1", nodes=3, nproc_per_node=2,
                              command=["train.py", "--epochs", "3"], gpus_per_node=2,
                              env={"OMP_NUM_THREADS": "4"})
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1 and replicas["Worker"]["replicas"] == 2
    for role in ("Master", "Worker"):
        (container,) = replicas[role]["template"]["spec"]["containers"]
        assert container["name"] == "pytorch" and container["image"] == "registry/lm:1"
        assert container["command"] == ["torchrun", "--nproc-per-node=2", "train.py",
                                        "--epochs", "3"]
        assert container["resources"] == {"limits": {"nvidia.com/gpu": 2}}
        assert container["env"] == [{"name": "OMP_NUM_THREADS", "value": "4"}]
    assert "Worker" not in pytorchjob_manifest("one", "img", nodes=1, nproc_per_node=1,
                                               command=["t.py"])["spec"]["pytorchReplicaSpecs"]
    with pytest.raises(ValueError, match="not a Kubernetes name"):
        pytorchjob_manifest("Bad_Name", "img", nodes=1, nproc_per_node=1, command=["t.py"])


def test_parallax_manifest_prints_it(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "parallax.cli", "manifest", "--name", "lm",
                           "--image", "img:1", "--nodes", "2", "--nproc-per-node", "2",
                           "train.py", "--lr", "0.1"], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == pytorchjob_manifest(
        "lm", "img:1", nodes=2, nproc_per_node=2, command=["train.py", "--lr", "0.1"])


@pytest.fixture(scope="module")
def local_result(tmp_path_factory) -> dict:
    """The case launched locally, 2 machines x 2 workers: what both schedulers must equal."""
    out = tmp_path_factory.mktemp("local") / "local.pt"
    proc = subprocess.run([sys.executable, "-m", "parallax.cli", "run", "--machines", "2",
                           "--nproc-per-machine", "2", str(WORKER), str(out), CASE],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


def _run_nodes(commands: list[tuple[list[str], dict[str, str]]]) -> None:
    """Start every node's command at once (as srun or the operator would), wait for all."""
    procs = [subprocess.Popen(cmd, env={**os.environ, **env}, cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for cmd, env in commands]
    outputs = [proc.communicate(timeout=300) for proc in procs]
    for proc, (_, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err[-3000:]


def _assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys() == {CASE[1:]}
    for name, value in want[CASE[1:]].items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(got[CASE[1:]][name], value, rtol=1e-12, atol=0)


def test_srun_two_nodes_equal_the_local_launch(local_result, tmp_path):
    """What ``srun --nodes=2 --ntasks-per-node=1 parallax run --slurm ...`` starts: one agent
    per node, told only SLURM's variables (both nodes this host here)."""
    out = tmp_path / "slurm.pt"
    cmd = [sys.executable, "-m", "parallax.cli", "run", "--slurm", "--nproc-per-machine", "2",
           str(WORKER), str(out), CASE]
    base = {"SLURM_JOB_NODELIST": "127.0.0.1,127.0.0.1", "SLURM_JOB_ID": str(os.getpid()),
            "SLURM_NTASKS_PER_NODE": "1"}
    _run_nodes([(cmd, {**base, "SLURM_NODEID": str(node)}) for node in range(2)])
    _assert_same(torch.load(out), local_result)


def test_the_manifests_command_on_two_pods_equals_the_local_launch(local_result, tmp_path):
    """The manifest's container command, with the variables the training operator sets in
    each pod (both pods this host here; ``torchrun`` is ``python -m torch.distributed.run``)."""
    out = tmp_path / "k8s.pt"
    job = pytorchjob_manifest("equivalence", "img", nodes=2, nproc_per_node=2,
                              command=[str(WORKER), str(out), CASE])
    command = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][
        0]["command"]
    assert command[0] == "torchrun"
    cmd = [sys.executable, "-m", "torch.distributed.run", *command[1:]]
    pod = {"PET_NNODES": "2", "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": "29613"}
    _run_nodes([(cmd, {**pod, "PET_NODE_RANK": str(rank)}) for rank in range(2)])
    _assert_same(torch.load(out), local_result)
