"""Distributed training equals the single-device program with the same global batch.

For each cluster shape, one group of workers trains the whole matrix of tests/equivalence_cases.py
(models x optimizers x clipping x float32/float64 x averaging semantics x partition counts) and
exports plain state_dicts; here every case is compared with the single-process reference.

Every case runs across machines: the matrix is split in two parts (`half_of_matrix`: by a hash
of the case's key, five sixths and one, plus what the plan and search tests read, plus
whatever case a part needs to meet every value of every option, alone and with every
architecture), the sixth on 2x2 and the rest on 2x1; the one-machine shapes run a sample
of it (`sampled_cases`: 1x1 an eighth, 1x2 a sixteenth: its two workers on one machine cost
twice 1x1's one, and 2x2 runs two workers a machine too). That keeps the suite within its time
budget; ``PARALLAX_FULL_MATRIX=1`` runs the whole matrix on every shape.

Difference measure, per parameter: max |parallax - reference| / max |reference|, the largest
over all parameters. Bounds: 1e-5 in float32 (summation order differs between one device and
W workers), 1e-9 in float64, where no real error can hide.
"""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from equivalence_cases import (
    PLAN_VARIANTS,
    Case,
    all_cases,
    build,
    coverage_keys,
    half_of_matrix,
    sampled_cases,
    single_device_reference,
)

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "scripts" / "equivalence_worker.py"
TOPOLOGIES = {"1x1": (1, 1), "1x2": (1, 2), "2x1": (2, 1), "2x2": (2, 2)}  # machines x workers
# topology -> the part of the matrix it runs (the worker's FILTER) and why the rest is skipped
SAMPLED = {} if os.environ.get("PARALLAX_FULL_MATRIX") == "1" else {
    "1x1": ("sample:8", "1x1 runs a 1/8 sample of the matrix"),
    "1x2": ("sample:16:4", "1x2 runs a 1/16 sample of the matrix"),
    "2x1": ("half:0", "the case runs across machines on 2x2 (part 1 of the matrix)"),
    "2x2": ("half:1", "the case runs across machines on 2x1 (part 0 of the matrix)"),
}
TOLERANCE = {"float32": 1e-5, "float64": 1e-9}
CASES = all_cases()


@functools.cache
def _part_keys(part: str) -> frozenset[str]:
    kind, _, number = part.partition(":")
    if kind == "sample":
        every, _, offset = number.partition(":")
        cases = sampled_cases(int(every), int(offset or 0))
    else:
        cases = half_of_matrix(int(number))
    return frozenset(case.key for case in cases)


@functools.cache
def _distributed_results(topology: str, out_dir: str) -> dict:
    machines, per_machine = TOPOLOGIES[topology]
    out = Path(out_dir) / f"equivalence-{topology}.pt"
    cmd = [sys.executable, "-m", "parallax.cli", "run", "--machines", str(machines),
           "--nproc-per-machine", str(per_machine), str(WORKER), str(out)]
    if topology in SAMPLED:
        cmd.append(SAMPLED[topology][0])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, f"workers failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return torch.load(out, weights_only=False)


def trained(topology: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    """``(topology, every case's results)``: the matrix trained on that cluster shape, once."""
    out_dir = tmp_path_factory.getbasetemp() / "equivalence"
    out_dir.mkdir(exist_ok=True)
    return topology, _distributed_results(topology, str(out_dir))


# The one-machine shapes; test_equivalence_machines.py runs the same tests on the others, a
# file of its own so that the suite's two pytest processes (``--dist loadfile`` gives each
# whole files) train the two halves side by side rather than one after the other.
@pytest.fixture(scope="module", params=["1x1", "1x2"])
def distributed(request, tmp_path_factory) -> tuple[str, dict]:
    return trained(request.param, tmp_path_factory)


@functools.cache
def _reference(case: Case, world: int) -> dict[str, torch.Tensor]:
    return single_device_reference(case, world)


def relative_difference(got: dict, want: dict) -> float:
    return max(float((got[k].double() - want[k].double()).abs().max()
                     / want[k].double().abs().max().clamp_min(1e-300)) for k in want)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.key)
def test_distributed_equals_single_device(distributed, case: Case) -> None:
    topology, results = distributed
    machines, per_machine = TOPOLOGIES[topology]
    world = machines * per_machine
    if topology in SAMPLED and case.key not in _part_keys(SAMPLED[topology][0]):
        pytest.skip(SAMPLED[topology][1])
    got = {k: v for k, v in results[case.key].items() if not k.startswith("__")}
    want = _reference(case, world)
    assert set(got) == set(want)
    difference = relative_difference(got, want)
    assert difference <= TOLERANCE[case.dtype], (
        f"{case.key} on {topology}: relative difference {difference:.3g}")


def test_the_halves_run_every_case_across_machines_and_each_meets_every_option() -> None:
    halves = [half_of_matrix(0), half_of_matrix(1)]
    keys = [{case.key for case in half} for half in halves]
    assert keys[0] | keys[1] == {case.key for case in CASES}
    everything = set().union(*(coverage_keys(case) for case in CASES))
    for half in halves:
        assert set().union(*(coverage_keys(case) for case in half)) == everything
    # what the split is for: the 4-process shape runs about a quarter, the other the rest
    assert len(halves[1]) < 0.3 * len(CASES) and len(halves[0]) < 0.9 * len(CASES)


@pytest.mark.parametrize("case", [c for c in CASES if c.dtype == "float32"][::7],
                         ids=lambda c: c.key)
def test_training_moves_every_parameter(case: Case) -> None:
    """Guards the comparison itself: 5+ steps move every parameter far beyond the tolerance,
    so a runner that skipped updates (of dense or of sparse parameters) could not pass."""
    initial = {k: v.detach().clone()
               for k, v in build(case, reference=True)[0].state_dict().items()}
    trained = _reference(case, 1)
    for name, value in initial.items():
        moved = float((trained[name] - value).abs().max() / value.abs().max())
        assert moved > 10 * TOLERANCE[case.dtype], f"{name} barely moved ({moved:.2g})"


def test_plan_puts_each_parameter_where_the_design_says(distributed) -> None:
    topology, results = distributed
    plans = {tuple(key.split("-")[:2]): json.loads(r["__plan__"]) for key, r in results.items()
             if not any(variant in key for variant in PLAN_VARIANTS)}
    by_arch = {key: {p["name"]: p["sync"] for p in plan["parameters"]}
               for key, plan in plans.items()}
    sync = {model: placement for (arch, model), placement in by_arch.items() if arch == "hybrid"}
    # one worker: the hybrid replicates every table after the warm-up (nothing to exchange),
    # updated where touched (AllGatherv's rows)
    served = "allgatherv" if math.prod(TOPOLOGIES[topology]) == 1 else "ps"
    assert set(sync["dense"].values()) == {"allreduce"}
    assert sync["sparse"] == {"embedding.weight": served}
    # The bag's rows are 12 bytes, less than an id, but the whole bag is so small that its
    # AllReduced gradient would go by one all_to_all to every rank (small sums on CPU:
    # parallax.engine.tables.reduction), more bytes than serving the rows: it stays on the PS
    # on every topology (tests/integration/test_traffic.py moves a larger narrow table).
    assert sync["mixed"] == {"embedding.weight": served, "bag.weight": served,
                             "hidden.weight": "allreduce", "hidden.bias": "allreduce",
                             "out.weight": "allreduce", "out.bias": "allreduce"}
    # Tied input/output embedding: read densely by the decoder, so it is dense.
    assert sync["tied"]["embedding.weight"] == "allreduce"
    # Untraceable: the module rule alone still finds the embedding.
    assert sync["untraceable"] == {"embedding.weight": served, "out.weight": "allreduce",
                                   "out.bias": "allreduce"}
    # Plain parameters read only through gathers are found by the fx trace.
    gather_sparse = {p["name"] for p in plans[("hybrid", "gather")]["parameters"] if p["sparse"]}
    assert {n: s for n, s in sync["gather"].items() if n in gather_sparse} == {
        "table": served, "bias_rows": served, "wide": served}
    # The baselines: AllGatherv for sparse under allreduce; everything on servers under ps.
    assert by_arch[("allreduce", "mixed")] == {**sync["mixed"], "embedding.weight": "allgatherv",
                                               "bag.weight": "allgatherv"}
    for arch in ("ps", "optps"):
        assert set(by_arch[(arch, "mixed")].values()) == {"ps"}
        assert set(by_arch[(arch, "tied")].values()) == {"ps"}
    # After the warm-up, alpha_threshold=0 moved every sparse table of the hybrid to AllReduce
    # (AllGatherv keeps sparse gradients for SparseAdam); α was measured on the way.
    for key, result in results.items():
        if "migrate" in key:
            plan = json.loads(result["__plan__"])
            moved = {p["name"]: p["sync"] for p in plan["parameters"] if p["sparse"]}
            want = "allgatherv" if "sparsegrad" in key or served == "allgatherv" else "allreduce"
            assert moved and set(moved.values()) == {want}, key
            assert all(0 < p["alpha"] <= 1 for p in plan["parameters"] if p["sparse"])


def test_search_in_training_sampled_chose_and_applied_a_count(distributed) -> None:
    """The search cases above really searched: samples taken as the papers sample (start at
    #servers, then doubling or halving), a count chosen within max_partitions=4 and applied
    to every table of the group (the equality with single-device training is checked above)."""
    topology, results = distributed
    servers = TOPOLOGIES[topology][0]
    searched = [key for key in results if "search" in key]
    assert len(searched) == len([c for c in CASES if c.search])
    for key in searched:
        plan = json.loads(results[key]["__plan__"])
        if math.prod(TOPOLOGIES[topology]) == 1 and key.startswith("hybrid"):
            # one worker: the hybrid replicated the tables after the warm-up, nothing to search
            assert plan["partition_searches"] == [], key
            assert not any(p["sync"] == "ps" for p in plan["parameters"] if p["sparse"]), key
            continue
        (record,) = plan["partition_searches"]
        counts = [sample["partitions"] for sample in record["samples"]]
        assert record["source"] == "searched" and counts[0] == servers, (key, record)
        assert all(1 <= c <= 4 for c in counts) and len(set(counts)) == len(counts), record
        assert min(counts) <= record["partitions"] <= max(counts), record
        on_servers = {p["name"] for p in plan["parameters"] if p["sync"] == "ps" and p["sparse"]}
        assert set(record["tables"]) == on_servers, (key, record)
        for name in record["tables"]:
            assert results[key]["__partitions__"][name] == record["partitions"], key


# The fast tier's equivalence: one case per architecture (clipping, local aggregation and
# partition counts among them), on 2 machines x 1 worker; the other start modes run them too.
FAST_KEYS = ["hybrid-mixed-adam-densegrad-clip0.05-float64",
             "allreduce-mixed-adam-densegrad-clip0.05-float64-P3",
             "ps-mixed-adam-densegrad-clip0.05-float64-P3-localagg",
             "optps-mixed-adam-densegrad-noclip-float64"]
START_MODE_FILTER = ",".join(f"={key}" for key in FAST_KEYS)


@pytest.mark.fast
def test_one_case_per_architecture_equals_single_device(tmp_path: Path) -> None:
    out = tmp_path / "fast.pt"
    cmd = [sys.executable, "-m", "parallax.cli", "run", "--machines", "2",
           "--nproc-per-machine", "1", str(WORKER), str(out),
           ",".join(f"={key}" for key in FAST_KEYS)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = torch.load(out, weights_only=False)
    assert sorted(results) == sorted(FAST_KEYS)
    by_key = {case.key: case for case in CASES}
    for key in FAST_KEYS:
        case = by_key[key]
        got = {k: v for k, v in results[key].items() if not k.startswith("__")}
        assert relative_difference(got, _reference(case, 2)) <= TOLERANCE[case.dtype], key


@pytest.mark.parametrize("mode", ["torchrun", "self-launch"])
def test_other_start_modes_train_the_same(mode: str, tmp_path: Path) -> None:
    """Under an outside torchrun parallax just joins; in a plain ``python train.py`` with a
    resource file, get_runner launches the workers itself. Both give the same parameters."""
    out = tmp_path / "out.pt"
    if mode == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", str(WORKER), str(out), START_MODE_FILTER]
    else:
        resources = tmp_path / "resources.txt"
        resources.write_text("# two emulated machines, one worker each\nlocalhost\nlocalhost\n")
        cmd = [sys.executable, str(WORKER), str(out), START_MODE_FILTER,
               "--resources", str(resources)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-6000:]
    results = torch.load(out, weights_only=False)
    cases = [c for c in CASES if c.key in FAST_KEYS]
    assert len(cases) == len(FAST_KEYS) and set(results) == set(FAST_KEYS)
    for case in cases:
        got = {k: v for k, v in results[case.key].items() if not k.startswith("__")}
        assert relative_difference(got, _reference(case, 2)) <= TOLERANCE[case.dtype]
