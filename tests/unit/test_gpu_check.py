"""`scripts/gpu_check.sh` on this CPU host: it says there is no CUDA device, writes its record
and exits 2; its plan names scripts that exist; and its comparison with the single-device
reference (what it reports for the CUDA runs) passes an equal result and flags a different
one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from equivalence_cases import all_cases, single_device_reference

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402


def _script(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--out",
                           str(tmp_path), *args], capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable,
                               "CUDA_VISIBLE_DEVICES": ""})


def test_it_runs_the_projects_venv_python_when_no_python_is_named(tmp_path: Path) -> None:
    """A fresh clone after scripts/setup.sh: torch is in .venv only (on 26b56e5 the script ran
    the machine's python3 and ended with ModuleNotFoundError: torch)."""
    checkout = tmp_path / "checkout"
    (checkout / "scripts").mkdir(parents=True)
    (checkout / "benchmarks").mkdir()
    (checkout / ".venv" / "bin").mkdir(parents=True)
    (checkout / "scripts" / "gpu_check.sh").write_text(
        (ROOT / "scripts" / "gpu_check.sh").read_text())
    (checkout / "benchmarks" / "gpu_check.py").write_text("import sys; print(sys.argv)\n")
    venv_python = checkout / ".venv" / "bin" / "python"
    venv_python.write_text("#!/bin/sh\necho venv-python \"$@\"\n")
    venv_python.chmod(0o755)
    proc = subprocess.run(["bash", str(checkout / "scripts" / "gpu_check.sh"), "--plan"],
                          capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "venv-python benchmarks/gpu_check.py --plan"


def test_without_cuda_it_says_so_and_exits_2(tmp_path: Path) -> None:
    proc = _script(tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "no CUDA device here" in proc.stderr
    record = json.loads((tmp_path / "gpu-check.json").read_text())
    assert record["environment"]["cuda_available"] is False and record["checks"] == {}
    assert [c["name"] for c in record["plan"]] == [
        "pytest-gpu", "equivalence-cuda-1x1", "equivalence-cuda-1xN", "pooled-cuda-2x2",
        "lm-cuda-1x1",
        "profile-lm-cuda-1x1", "local-aggregation-cpu-2x4", "partitions-cpu-4x1",
        "partition-surface-cpu"]


def test_the_plan_runs_scripts_that_exist(tmp_path: Path) -> None:
    proc = _script(tmp_path, "--plan")
    assert proc.returncode == 0, proc.stderr
    for check in gpu_check.checks(tmp_path, gpus=1):
        scripts = [part for part in check.command if part.endswith(".py")]
        assert scripts and all(Path(s).is_file() for s in scripts), check.name
        assert check.name in proc.stdout
    # one GPU: the two ranks share it over gloo; two GPUs: one each, NCCL
    one_gpu = {c.name: c for c in gpu_check.checks(tmp_path, gpus=1)}["equivalence-cuda-1xN"]
    assert not one_gpu.skip and one_gpu.env == {"PARALLAX_SHARED_GPU": "1"}
    two_gpus = {c.name: c for c in gpu_check.checks(tmp_path, gpus=2)}["equivalence-cuda-1xN"]
    assert not two_gpus.skip and two_gpus.env == {}


def test_a_check_left_without_time_is_not_run(tmp_path: Path) -> None:
    check = gpu_check.checks(tmp_path, gpus=1)[0]
    result = gpu_check.run_check(check, deadline=0.0)
    assert result == {"status": "not run", "why": "out of time (--deadline-s)"}


def test_the_comparison_passes_an_equal_run_and_flags_a_different_one(tmp_path: Path) -> None:
    case = next(c for c in all_cases() if c.dtype == "float64")
    want = single_device_reference(case, 1)
    results = tmp_path / "run.pt"
    torch.save({case.key: {**want, "__plan__": "{}"}}, results)
    equal = gpu_check.compare_equivalence(results, world=1)
    assert equal == {"cases": 1, "failed": [], "largest_relative_difference": 0.0,
                     "largest_by_dtype": {"float64": 0.0}}
    name = next(iter(want))
    torch.save({case.key: {**want, name: want[name] * (1 + 1e-6)}}, results)
    different = gpu_check.compare_equivalence(results, world=1)
    assert different["failed"] == [case.key]
    assert 1e-7 < different["largest_relative_difference"] < 1e-5
    assert different["largest_by_dtype"]["float64"] == different["largest_relative_difference"]
