"""The GPU path in one command (`bash scripts/gpu_check.sh`): what this 2-core CPU host cannot
check, run on a machine with CUDA (and 16 CPU cores), written to one JSON record and a short
report.

Checks, each a subprocess with its own timeout (a failure is recorded with the end of its
output, and the next check runs; ``--deadline-s`` caps them all, for a lease of device time):

* ``pytest-gpu``: the tests marked ``gpu`` (skipped where CUDA is not: CI);

* ``equivalence-cuda-1x1``: the equivalence matrix's sampled cases (``sample:3``) trained by one
  worker on ``cuda:0`` (process groups on NCCL), each compared with the single-device CPU
  reference (float64 1e-9, float32 1e-5 relative), as ``tests/equivalence`` does on the CPU;
* ``equivalence-cuda-1xN``: the same with one worker per GPU (NCCL) when the host has two or
  more; with one GPU, two workers share it (``PARALLAX_SHARED_GPU=1``: process groups on gloo,
  since NCCL refuses two ranks on one GPU), which checks the multi-rank CUDA paths but not
  NCCL's own collectives;
* ``pooled-cuda-2x2``: ``tests/integration/test_pooled.py`` with CUDA visible: bags pooled on
  their owners (whole, by rows, as column slices) by 2 emulated machines x 2 workers sharing
  the GPU (gloo), against the single-device CPU reference;
* ``lm-cuda-1x1``: the benchmark LM, one worker on CUDA, `plain` PyTorch against parallax
  (`hybrid`) and DDP (`ddp-dense`: dense gradients: NCCL cannot AllReduce sparse ones): step times
  and peak memory (``benchmarks/compare.py``);
* ``profile-lm-cuda-1x1``: parallax's step on that GPU under torch.profiler: operators by
  self CPU time and the host synchronisations by the Python lines that ask for them
  (``out/profile/hybrid-rank0.txt``);
* ``partitions-cpu-4x1``: the partition-count search against brute force on 4 emulated
  machines (``benchmarks/partitions.py``, CPU workers: ``CUDA_VISIBLE_DEVICES=``), and
  ``partition-surface-cpu``: one server's partition surface with a thread per core
  (``benchmarks/partition_surface.py``: whether partitions pay where cores are many), and
  ``local-aggregation-cpu-2x4``: 4 workers per machine, hybrid/optps/ps
  (``benchmarks/compare.py``) — on an emulated 1 Gbit/s link where network namespaces can be
  made (root, iproute2), else with none (``--rate none``: CPU-bound figures).

Without CUDA it says so, writes the record (``cuda_available: false``) and exits 2. ``--plan``
prints the checks' commands and exits 0 (``tests/unit/test_gpu_check.py`` runs both on the
CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = {"float32": 1e-5, "float64": 1e-9}


@dataclass
class Check:
    """One check: its command, environment additions and time limit."""

    name: str
    command: list[str]
    timeout_s: int
    env: dict[str, str] = field(default_factory=dict)
    skip: str = ""  # why it is not run here ("" = it runs)


def environment() -> dict[str, Any]:
    import torch

    cuda = torch.cuda.is_available()
    nccl = None
    if cuda:
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as error:  # torch built without NCCL
            nccl = f"unavailable: {error}"
    return {"torch": torch.__version__, "cuda_available": cuda,
            "cuda": torch.version.cuda, "nccl": nccl,
            "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            if cuda else [],
            "cpu_cores": os.cpu_count(), "python": platform.python_version(),
            "host": platform.node()}


def emulated_rate() -> str:
    """The 16-core checks' link: 1 Gbit/s emulated where network namespaces can be made
    (root, iproute2), else ``none`` (no emulated link: what they show is then CPU-bound)."""
    return "1gbit" if shutil.which("ip") and os.geteuid() == 0 else "none"


def checks(out: Path, gpus: int) -> list[Check]:
    py = sys.executable
    rate = emulated_rate()
    worker = str(ROOT / "tests" / "scripts" / "equivalence_worker.py")
    cpu_only = {"CUDA_VISIBLE_DEVICES": ""}
    return [
        # the gpu-marked files alone: collecting the whole suite would import what the GPU
        # machine may lack (the dev extras)
        Check("pytest-gpu",
              [py, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
               *map(str, sorted((ROOT / "tests").glob("*/test_cuda_*.py")))], 180),
        Check("equivalence-cuda-1x1",
              [py, "-m", "parallax.cli", "run", "--machines", "1", "--nproc-per-machine", "1",
               worker, str(out / "equivalence-cuda-1x1.pt"), "sample:3"], 420),
        # one GPU: NCCL refuses two ranks on it, so the two ranks share it over gloo
        # (PARALLAX_SHARED_GPU: CUDA tensors, uneven exchanges, but not NCCL's collectives)
        Check("equivalence-cuda-1xN",
              [py, "-m", "parallax.cli", "run", "--machines", "1", "--nproc-per-machine",
               str(max(gpus, 2)), worker, str(out / "equivalence-cuda-1xN.pt"), "sample:3"],
              420, env={} if gpus >= 2 else {"PARALLAX_SHARED_GPU": "1"}),
        # owner-side pooling on CUDA (every placement: whole, by rows, column slices) on 2
        # emulated machines x 2 workers sharing the GPU, against the CPU reference
        Check("pooled-cuda-2x2",
              [py, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               str(ROOT / "tests" / "integration" / "test_pooled.py")], 300,
              env={"PARALLAX_SHARED_GPU": "1"}),
        Check("lm-cuda-1x1",
              [py, str(ROOT / "benchmarks" / "compare.py"), "--workload", "lm", "--machines",
               "1", "--nproc-per-machine", "1", "--rate", "none",
               # DDP with dense gradients: NCCL has no AllReduce of sparse tensors
               "--systems", "plain", "hybrid", "ddp-dense",
               "--isolate", "--repeats", "3", "--steps", "20", "--no-plot",
               "--out", str(out / "lm-cuda-1x1.json")], 420),
        # where parallax's one-worker step spends the host's time, and which lines make it
        # wait for the GPU (the H200 run: 214 launches and 45 synchronisations per step)
        Check("profile-lm-cuda-1x1",
              [py, str(ROOT / "benchmarks" / "compare.py"), "--workload", "lm", "--machines",
               "1", "--nproc-per-machine", "1", "--rate", "none", "--systems", "hybrid",
               "--repeats", "1", "--steps", "10", "--no-plot",
               "--profile", str(out / "profile"), "--out", str(out / "profile-lm.json")], 180),
        Check("local-aggregation-cpu-2x4",
              [py, str(ROOT / "benchmarks" / "compare.py"), "--workload", "lm", "--machines",
               "2", "--nproc-per-machine", "4", "--rate", rate, "--systems", "hybrid",
               "optps", "ps", "--isolate", "--repeats", "3", "--no-plot",
               "--out", str(out / "local-aggregation-cpu-2x4.json")], 540, env=cpu_only),
        Check("partitions-cpu-4x1",
              [py, str(ROOT / "benchmarks" / "partitions.py"), "--machines", "4",
               "--nproc-per-machine", "1", "--rate", rate,
               # beyond 8 the samples only grow slower (16 cores, 2026-11-26): a check that
               # fits the 10 minutes
               "--partitions", "1", "2", "3", "4", "6", "8", "--no-plot"], 300, env=cpu_only),
        # Table 2's parallel share on a server with many cores (the 2-core host shows none:
        # partition-surface-lm): one server's push and update against P, its threads the cores
        Check("partition-surface-cpu",
              [py, str(ROOT / "benchmarks" / "partition_surface.py"), "--threads",
               str(os.cpu_count() or 1), "--counts", "1", "2", "4", "8", "16", "32",
               "--rounds", "3", "--steps", "20", "--name", "lm-many-cores",
               "--out", str(out)], 240, env=cpu_only),
    ]


def run_check(check: Check, deadline: float = float("inf")) -> dict[str, Any]:
    """Run ``check`` within its own limit and what is left before ``deadline`` (monotonic)."""
    if check.skip:
        return {"status": "not run", "why": check.skip}
    timeout = min(check.timeout_s, int(deadline - time.monotonic()))
    if timeout < 30:
        return {"status": "not run", "why": "out of time (--deadline-s)"}
    check = replace(check, timeout_s=timeout)
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}"
           f"{os.environ.get('PYTHONPATH', '')}", **check.env}
    began = time.monotonic()
    try:
        proc = subprocess.run(check.command, cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=check.timeout_s)
    except subprocess.TimeoutExpired as error:
        return {"status": "timed out", "seconds": check.timeout_s,
                "output_tail": _tail(error.stdout, error.stderr)}
    result: dict[str, Any] = {"status": "ok" if proc.returncode == 0 else "failed",
                              "exit": proc.returncode,
                              "seconds": round(time.monotonic() - began, 1),
                              "output_tail": _tail(proc.stdout, proc.stderr)}
    return result


def _tail(*texts: Any, chars: int = 3000) -> str:
    joined = "\n".join(t.decode() if isinstance(t, bytes) else (t or "") for t in texts)
    return joined[-chars:]


def compare_equivalence(results_file: Path, world: int) -> dict[str, Any]:
    """Each case's relative difference from the single-device CPU reference."""
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    from equivalence_cases import all_cases, single_device_reference

    got_all = torch.load(results_file, map_location="cpu", weights_only=False)
    by_key = {case.key: case for case in all_cases()}
    worst: dict[str, float] = {}
    by_dtype: dict[str, float] = {}
    failed = []
    for key, state in got_all.items():
        case = by_key[key]
        got = {k: v for k, v in state.items() if not k.startswith("__")}
        want = single_device_reference(case, world)
        difference = max(float((got[k].double() - want[k].double()).abs().max()
                               / want[k].double().abs().max().clamp_min(1e-300))
                         for k in want)
        worst[key] = difference
        by_dtype[case.dtype] = max(by_dtype.get(case.dtype, 0.0), difference)
        if difference > TOLERANCE[case.dtype]:
            failed.append(key)
    return {"cases": len(worst), "failed": failed,
            "largest_relative_difference": max(worst.values(), default=0.0),
            "largest_by_dtype": by_dtype}


def report(record: dict[str, Any]) -> str:
    env = record["environment"]
    lines = [f"gpu_check: torch {env['torch']}, CUDA {env['cuda']}, NCCL {env['nccl']}, "
             f"GPUs {env['gpus'] or 'none'}, {env['cpu_cores']} CPU cores"]
    for name, result in record["checks"].items():
        extra = result.get("why") or ""
        if "equivalence" in result:
            eq = result["equivalence"]
            largest = ", ".join(f"{dtype} {value:.3g}"
                                for dtype, value in sorted(eq["largest_by_dtype"].items()))
            extra = (f"{eq['cases']} cases, {len(eq['failed'])} above tolerance, largest "
                     f"relative difference {largest}")
        lines.append(f"  {name:28s} {result['status']:10s} {extra}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "gpu-check",
                        help="folder for the record (gpu-check.json), report and results")
    parser.add_argument("--plan", action="store_true",
                        help="print the checks' commands and exit")
    parser.add_argument("--only", nargs="*", default=None, help="run only these checks")
    parser.add_argument("--deadline-s", type=float, default=float("inf"),
                        help="end every check within this many seconds of the start (a check "
                             "left with under 30 s is not run); for a lease of device time")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    env = environment()
    planned = checks(args.out, len(env["gpus"]))
    if args.plan:
        for check in planned:
            print(f"{check.name}: {' '.join(check.command)}"
                  + (f"  [not run: {check.skip}]" if check.skip else ""))
        return 0
    record: dict[str, Any] = {"environment": env, "checks": {},
                              "plan": [asdict(check) for check in planned]}
    if not env["cuda_available"]:
        print(f"gpu_check: no CUDA device here (torch {env['torch']}, "
              f"torch.cuda.is_available() is False): nothing to check; run it on a machine "
              f"with a GPU", file=sys.stderr)
        (args.out / "gpu-check.json").write_text(json.dumps(record, indent=1))
        return 2
    deadline = time.monotonic() + args.deadline_s
    for check in planned:
        if args.only is not None and check.name not in args.only:
            continue
        print(f"gpu_check: {check.name} ...", flush=True)
        result = run_check(check, deadline)
        print(f"gpu_check: {check.name} {result['status']} "
              f"({result.get('seconds', 0)} s)", flush=True)
        results_file = args.out / f"{check.name}.pt"
        if result["status"] == "ok" and results_file.exists():
            world = 1 if check.name.endswith("1x1") else max(len(env["gpus"]), 2)
            result["equivalence"] = compare_equivalence(results_file, world)
            if result["equivalence"]["failed"]:
                result["status"] = "different"
        record["checks"][check.name] = result
        (args.out / "gpu-check.json").write_text(json.dumps(record, indent=1))
    text = report(record)
    (args.out / "gpu-check.md").write_text(text + "\n")
    print(text)
    return 0 if all(r["status"] in ("ok", "not run") for r in record["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
