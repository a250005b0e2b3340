"""The benchmark harness runs end to end at tiny sizes (2 machines x 1 worker, 1-2 steps, a
2,000-word vocabulary), so it cannot rot: compare.py and every experiment script, each writing
its JSON, markdown and PNG with sane values (full runs: scripts/bench.sh, BENCHMARKS.md)."""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
TINY = ["--steps", "2", "--warmup", "1", "--vocab", "2000", "--repeats", "1"]
PARALLAX = {"hybrid", "optps", "ps", "allreduce"}

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("tc"),
                                reason="the emulated network needs root and iproute2")


def run_script(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return proc


def check_record(result: dict, *, machines: int = 2) -> None:
    """The fields every compare record has, and the plan's for parallax systems."""
    system = result["system"]
    assert result["median_step_s"] > 0 and result["items_per_s"] > 0, system
    source = result["provenance"]
    assert len(source["commit"]) == 40 and source["host"]["cores"] >= 1, source
    repeats = result.get("repeats", [result])
    for repeat in repeats:
        assert len(repeat["step_times_s"]) == result["steps"], system
        assert (min(repeat["step_times_s"]) <= repeat["step_p10_s"] <= repeat["median_step_s"]
                <= repeat["step_p90_s"] <= max(repeat["step_times_s"])), system
    if len(repeats) > 1:  # the median of the repeats' medians, and their range
        medians = sorted(r["median_step_s"] for r in repeats)
        assert result["repeat_min_step_s"] == medians[0], system
        assert result["repeat_max_step_s"] == medians[-1], system
        assert medians[0] <= result["median_step_s"] <= medians[-1], system
        assert result["items_per_s"] == pytest.approx(
            repeats[0]["items_per_s"] * repeats[0]["median_step_s"] / result["median_step_s"])
    assert result["peak_rss_mib"] > 0 and len(result["peak_rss_mib_per_rank"]) == machines
    # CPU time per step by thread kind, one value per rank (the kernel counts in ticks of
    # 10 ms: a two-step smoke run may read 0, never less)
    by_thread = result["cpu_ms_per_step_by_thread"]
    assert set(by_thread) == {"main", "gloo", "other"}, system
    assert all(len(v) == machines and min(v) >= 0 for v in by_thread.values()), by_thread
    if len(repeats) > 1:  # each repeat's own, the median of them on top, rank by rank
        for kind, top in by_thread.items():
            each = [r["cpu_ms_per_step_by_thread"][kind] for r in repeats]
            assert top == pytest.approx([statistics.median(v) for v in zip(*each, strict=True)],
                                        abs=0.01)
    assert result["peak_rss_scope"] == "system"
    # one worker per machine: a machine's peak is its worker's
    assert result["peak_rss_mib_per_machine"] == pytest.approx(result["peak_rss_mib"])
    if not system.startswith("torchrec"):
        # the RSS before building plus the model's memory: same order as the measured peak
        assert 0.5 < result["predicted_rss_mib"] / result["peak_rss_mib"] < 1.5, result
    if machines > 1 and not system.startswith("local"):  # "local" exchanges nothing
        assert result["wire_bytes_per_machine_step"] > 0, system
    if system.partition("-")[0] in PARALLAX:
        assert 0 < result["alpha_model"] <= 1, system
        if machines > 1:
            assert result["predicted_bytes_per_machine_step"] > 0, system
            assert math.isfinite(result["wire_over_predicted"]), system
            # wire bytes add protocol headers to the payload the model counts, nothing else
            # of size: the ratio sits a little above 1
            assert 0.7 < result["wire_over_predicted"] < 1.5, (system, result)
            assert 0.7 < result["engine_over_predicted"] < 1.3, (system, result)
    else:
        assert result.get("alpha_model") is None, system


def check_outputs(out_dir: Path, name: str) -> dict:
    """<name>.json (every run succeeded), .md and a non-empty .png; the JSON."""
    data = json.loads((out_dir / f"{name}.json").read_text())
    assert data["experiment"] == name
    assert data["runs"] and all("results" in run for run in data["runs"]), data["runs"]
    markdown = (out_dir / f"{name}.md").read_text()
    assert "## Runs" in markdown and "wire/predicted" in markdown
    assert (out_dir / f"{name}.png").stat().st_size > 1000
    return data


def test_compare_smoke(tmp_path: Path) -> None:
    """The default systems and the no-exchange bound ("local-sparse": the single-device loop
    on every worker), two interleaved repeats (one launch each, the order rotated)."""
    out = tmp_path / "compare.json"
    defaults = ["hybrid", "optps", "ps", "allreduce", "ddp-sparse", "ddp-dense"]
    proc = run_script("compare.py", "--machines", "2", "--nproc-per-machine", "1", *TINY,
                      "--systems", *defaults, "local-sparse", "--repeats", "2",
                      "--out", str(out))
    results = {r["system"]: r for r in json.loads(out.read_text())}
    assert set(results) == {*defaults, "local-sparse"}
    # nothing crosses the machines in the timed steps of the loop that exchanges nothing
    assert results["local-sparse"]["wire_bytes_per_machine_step"] < 0.01 * results[
        "hybrid"]["wire_bytes_per_machine_step"]
    for result in results.values():
        check_record(result)
        assert len(result["repeats"]) == 2
        assert result["isolated"] is False and result["workload"] == "lm"
    # every parallax system sees the same batches, so measures the same α_model
    alphas = {results[s]["alpha_model"] for s in PARALLAX}
    assert max(alphas) - min(alphas) < 1e-9, alphas
    assert "| hybrid |" in proc.stdout and "wire bytes/machine/step" in proc.stdout
    assert "wire/predicted" in proc.stdout and "peak RSS/worker (MiB)" in proc.stdout
    assert "predicted/worker (MiB)" in proc.stdout
    assert "2 interleaved repeats" in proc.stdout and "repeat 2/2, launch 1/1 (optps" in proc.stdout
    assert out.with_suffix(".png").stat().st_size > 1000


def test_single_worker_against_the_plain_loop(tmp_path: Path) -> None:
    """One worker: parallax's hybrid beside the single-device loop itself (its overhead)."""
    out = tmp_path / "one.json"
    proc = run_script("compare.py", "--machines", "1", "--nproc-per-machine", "1", *TINY,
                      "--systems", "plain", "hybrid", "--no-plot", "--out", str(out))
    results = {r["system"]: r for r in json.loads(out.read_text())}
    assert set(results) == {"plain", "hybrid"}
    for result in results.values():
        check_record(result, machines=1)
    assert "vs plain" in proc.stdout


@pytest.mark.network  # may fetch Fashion-MNIST (Debian package) on first use
def test_table1_smoke(tmp_path: Path) -> None:
    """Its CNN row (the LM's records are the other smokes' own: compare, table4, scaling)."""
    run_script("table1.py", "--workloads", "cnn", "--machines", "2",
               "--nproc-per-machine", "1", *TINY, "--batch", "8", "--out-dir", str(tmp_path))
    data = check_outputs(tmp_path, "table1")
    runs = {run["label"]: run for run in data["runs"]}
    assert set(runs) == {"cnn"}
    assert {r["system"] for r in runs["cnn"]["results"]} == {"ps", "allreduce"}
    for result in runs["cnn"]["results"]:
        check_record(result)
        assert result["alpha_model"] == 1.0 and result["unit"] == "samples"  # all dense
    assert "| cnn | samples |" in (tmp_path / "table1.md").read_text()


def nmt_cached() -> bool:
    """Whether the NMT workload's verse pairs are already in the cache (else: no download)."""
    from corpora.kjv import default_cache_dir

    return (default_cache_dir() / "kjv-rv1909.tsv").exists()


def test_table4_smoke(tmp_path: Path) -> None:
    workloads = ["nmt"] if nmt_cached() else ["lm"]  # else the LM's run is compare's
    run_script("table4.py", "--workloads", *workloads, "--systems", "allreduce", "hybrid",
               "--machines", "2", "--nproc-per-machine", "1", *TINY, "--batch", "4",
               "--out-dir", str(tmp_path))
    data = check_outputs(tmp_path, "table4")
    assert [run["label"] for run in data["runs"]] == workloads
    for run in data["runs"]:
        results = run["results"]
        assert [r["system"] for r in results] == ["allreduce", "hybrid"]
        for result in results:
            check_record(result)
            assert result["unit"] == "words"
    assert "Table 4 analog" in (tmp_path / "table4.md").read_text()


def test_ablation_smoke(tmp_path: Path) -> None:
    """Seed 001's ablation: its BASE (both placements moved back) and the step before +OPSW,
    trained alike on the same batches (the placements move work, not what it computes)."""
    base, opau = "ps-direct+noopau+noopsw", "hybrid-aggregated+noopsw"
    run_script("ablation.py", "--workloads", "lm", "--systems", base, opau, "--machines", "2",
               "--nproc-per-machine", "1", *TINY, "--batch", "4", "--out-dir", str(tmp_path))
    data = check_outputs(tmp_path, "ablation")
    results = {r["system"]: r for r in data["runs"][0]["results"]}
    assert list(results) == [base, opau]
    for result in results.values():  # (not check_record: the byte model predicts the default
        # placements, which these move on purpose)
        assert result["median_step_s"] > 0 and result["wire_bytes_per_machine_step"] > 0
        assert result["steps"] == 2
    assert results[base]["architecture"] == "ps"
    assert results[base]["loss_last"] == pytest.approx(results[opau]["loss_last"], rel=1e-5)
    # the step ids and rows travel once a lookup, and the aggregates go to the workers
    assert (results[base]["engine_bytes_per_machine_step"]
            > results[opau]["engine_bytes_per_machine_step"])
    assert "cumulative ablation" in (tmp_path / "ablation.md").read_text()


def test_scaling_smoke(tmp_path: Path) -> None:
    run_script("scaling.py", "--machines", "1", "2", "3", "--systems", "hybrid", "ps",
               "allreduce", *TINY, "--out-dir", str(tmp_path))
    data = check_outputs(tmp_path, "scaling")
    assert [run["settings"]["machines"] for run in data["runs"]] == [1, 2, 3]
    for run in data["runs"]:
        for result in run["results"]:
            check_record(result, machines=run["settings"]["machines"])
    one = data["runs"][0]["results"][0]
    assert one["wire_over_predicted"] is None  # nothing crosses machines on one machine
    for system in ("hybrid", "ps", "allreduce"):
        normalised = data["normalised"][system]
        assert normalised["1"] == 1.0 and normalised["2"] > 0

    # the extrapolation's byte model is the engine's plan: same bytes from the same α
    sys.path.insert(0, str(BENCH))
    import extrapolate

    from parallax.planning.cost import Shape

    cfg = extrapolate.lm_config(data["runs"][0]["settings"])
    for run in data["runs"][1:]:
        machines = run["settings"]["machines"]
        for result in run["results"]:
            costs = extrapolate.parameter_costs(cfg, {
                name: (alpha * cfg.vocab, alpha * cfg.vocab)
                for name, alpha in result["alphas"].items()})
            model = extrapolate.predicted_bytes(result["system"], costs, Shape(machines, 1))
            assert model == pytest.approx(result["predicted_bytes_per_machine_step"],
                                          rel=1e-9), (machines, result["system"])
    # the rows it counts on the harness's batches are the α the runs measured
    used = extrapolate.rows_used(cfg, 1)
    for result in data["runs"][1]["results"]:
        for name, alpha in result["alphas"].items():
            assert used[name][0] / cfg.vocab == pytest.approx(alpha, rel=0.1), name
    run_script("extrapolate.py", "--scaling", str(tmp_path / "scaling.json"),
               "--machines", "16", "64", "--out", str(tmp_path / "extrapolation.json"))
    result = json.loads((tmp_path / "extrapolation.json").read_text())
    assert (tmp_path / "extrapolation.png").stat().st_size > 0
    assert [r["machines"] for r in result["measured"] if r["held_out"]] == [3, 3, 3]
    assert all(math.isfinite(r["validation_error"]) for r in result["measured"])
    assert [(r["machines"], r["workers"]) for r in result["predictions"]] == [
        (16, 1), (16, 8), (64, 1), (64, 8)]
    for row in result["predictions"]:
        for system in ("hybrid", "ps", "allreduce"):
            assert row[system]["step_s"] > 0 and row[system]["bytes"] > 0


def test_sparsity_sweep_smoke(tmp_path: Path) -> None:
    # one system: the loop over systems is compare.py's (test_compare_smoke)
    run_script("sparsity_sweep.py", "--points", "2000:5", "200:40", "--systems", "hybrid",
               "--machines", "2", "--nproc-per-machine", "1", "--steps", "2",
               "--warmup", "1", "--repeats", "1", "--out-dir", str(tmp_path))
    data = check_outputs(tmp_path, "sparsity")
    for run in data["runs"]:
        for result in run["results"]:
            check_record(result)
    points = data["points"]
    assert [(p["vocab"], p["seq_len"]) for p in points] == [(2000, 5), (200, 40)]
    # more words per batch over fewer rows: the sweep reaches from sparse towards dense
    assert 0 < points[0]["alpha_model"] < 0.5 < points[1]["alpha_model"] <= 1, points
    assert "α_model reached" in (tmp_path / "sparsity.md").read_text()


def test_bandwidth_sweep_smoke_isolated(tmp_path: Path) -> None:
    """One rate and one system (the loops over rates and systems are the other experiments'
    loops), in a launch of its own: --isolate's path."""
    run_script("bandwidth_sweep.py", "--rates", "100mbit", "--systems", "hybrid",
               "--machines", "2", "--nproc-per-machine", "1", *TINY, "--isolate",
               "--out-dir", str(tmp_path))
    data = check_outputs(tmp_path, "bandwidth-2x1")
    assert list(data["sweep"]) == ["100mbit"]
    results = data["sweep"]["100mbit"]
    assert [r["system"] for r in results] == ["hybrid"]
    for result in results:
        check_record(result)
        assert result["isolated"] is True and result["rate"] == "100mbit"
    assert "| hybrid |" in (tmp_path / "bandwidth-2x1.md").read_text()
