"""Bytes: what the engine counts per parameter matches the plan's Table-3 prediction, for every
architecture, and local aggregation measurably cuts inter-machine traffic.

The model (tests/scripts/traffic_worker.py) has one dense and one sparse parameter of known
sizes; every worker uses exactly 40 of 1000 rows per step, the two workers of a machine share
20 of them. Counted are the payloads the engine hands to its collectives (PS and AllGatherv
exchanges exactly; DDP's AllReduce buckets through the ring schedule, as c10d reports no bytes),
not bytes on a wire: the emulated-network benchmarks read those off interface counters.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from parallax.step.aggregation_trial import KEEP_MARGIN
from parallax.step.hooks import DENSE_SYNC_ACCOUNTS

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from launching import run_worker  # noqa: E402


@pytest.fixture(scope="module")
def traffic(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("traffic") / "traffic.json"
    run_worker("traffic_worker.py", str(out))
    return json.loads(out.read_text())


@pytest.mark.parametrize("run", ["allreduce", "ps", "optps", "hybrid", "hybrid-nolocalagg",
                                 "hybrid-flat", "hybrid-apart"])
def test_measured_inter_machine_bytes_match_the_plan(traffic, run: str) -> None:
    result = traffic[run]
    parameters = {"embedding.weight", "dense.weight", "dense.bias"}
    assert set(result["measured"]) == parameters | set(DENSE_SYNC_ACCOUNTS)
    assert all(result["measured"][name] == 0 for name in DENSE_SYNC_ACCOUNTS)  # DDP's here
    for name in parameters:
        measured = result["measured"][name]
        predicted = result["predicted"][name]
        assert measured > 0, f"{run}: nothing crossed machines for {name}"
        assert abs(measured - predicted) <= 0.10 * predicted, (
            f"{run} {name}: measured {measured:.0f} B vs predicted {predicted:.0f} B")


def test_alpha_is_measured_per_worker_and_per_machine(traffic) -> None:
    alpha, alpha_machine = traffic["hybrid"]["alpha"]["embedding.weight"]
    assert alpha == pytest.approx(40 / 1000)
    assert alpha_machine == pytest.approx(60 / 1000)  # 40 + 40 rows, 20 shared
    assert traffic["ps"]["alpha"]["embedding.weight"][1] is None  # no aggregation, no α_m


def test_hybrid_moves_a_table_to_allreduce_where_the_bytes_model_says_so(traffic) -> None:
    narrow = traffic["narrow"]
    assert narrow["alpha"] == 1.0
    assert narrow["sync"] == "allreduce"
    assert "AllReduce predicted" in narrow["reason"]
    # ... but not a table so small that its sum would go by one all_to_all to every rank
    small = traffic["narrow_small"]
    assert small["alpha"] == 1.0 and small["sync"] == "ps"
    # ... and the 16-wide table with α = 0.04 stays on the servers.
    assert traffic["hybrid"]["sync"]["embedding.weight"] == "ps"


def test_local_aggregation_cuts_inter_machine_bytes(traffic) -> None:
    merged = traffic["hybrid"]["measured"]["embedding.weight"]
    separate = traffic["hybrid-nolocalagg"]["measured"]["embedding.weight"]
    # A machine moves 60 merged rows instead of 2 x 40: a quarter less, minus count messages.
    assert merged <= 0.8 * separate, (merged, separate)
    assert traffic["optps"]["measured"]["dense.weight"] < traffic["ps"]["measured"][
        "dense.weight"]


def test_operations_placed_back_on_workers_cost_the_bytes_they_move(traffic) -> None:
    """Seed 001's ablation baselines: the same training, more traffic, as each says."""
    ps = traffic["ps"]["measured"]["embedding.weight"]
    # every id is looked up BATCH = 4 times a step: with the dedup on the servers its id, its
    # row and its gradient row travel 4 times (the count messages once)
    repeated = traffic["ps-dedupservers"]["measured"]["embedding.weight"]
    assert 3.8 * ps <= repeated <= 4.0 * ps, (repeated, ps)
    # the aggregated rows to every worker: each server holds 60 of the step's 120 rows (2
    # machines x 60) and sends them to the other machine's two workers, and receives as many
    # (the next rank, which sends the result back, is on the server's own machine); the
    # round trip's count message (24 B) goes to and comes from 2 workers there each way
    after = traffic["ps-afterworkers"]["measured"]["embedding.weight"]
    assert after - ps == pytest.approx(2 * 2 * 60 * 16 * 4 + 8 * 24, rel=0.02), (after, ps)
    # ... and so do the servers' dense parameters (ps): their whole aggregates
    assert (traffic["ps-afterworkers"]["measured"]["dense.weight"]
            > traffic["ps"]["measured"]["dense.weight"])
    assert traffic["placement_difference"]["ps-afterworkers"] < 1e-6
    assert traffic["placement_difference"]["ps-dedupservers"] < 1e-6


def test_hybrid_keeps_local_aggregation_only_where_merging_saves_bytes(traffic) -> None:
    # 40 + 40 rows merged into 60: the predicted saving is above the threshold, kept
    assert traffic["hybrid"]["local_aggregation"] is True
    assert "local aggregation kept" in traffic["hybrid"]["reason"]["embedding.weight"]
    # the workers of a machine share no row: α_m = 2 α, nothing to save, the hop is dropped
    apart = traffic["hybrid-apart"]
    alpha, alpha_machine = apart["alpha"]["embedding.weight"]
    assert alpha_machine == pytest.approx(2 * alpha)
    assert apart["local_aggregation"] is False
    assert "local aggregation off" in apart["reason"]["embedding.weight"]
    # ... and the bytes after the warm-up are those of every worker exchanging on its own
    assert apart["measured"]["embedding.weight"] == pytest.approx(
        traffic["hybrid-nolocalagg"]["measured"]["embedding.weight"], rel=0.05)


def test_hybrid_times_the_hop_its_bytes_rule_keeps_and_keeps_the_faster(traffic) -> None:
    trial = traffic["trial"]
    assert trial["settled_in_trial"] is False and trial["settled"] is True
    with_hop, without = trial["samples"]["True"], trial["samples"]["False"]
    assert with_hop > 0 and without > 0
    kept = with_hop * (1 + KEEP_MARGIN) <= without
    assert trial["local_aggregation"] is kept
    reason = trial["reason"]["embedding.weight"]
    assert ("kept by trial" if kept else "off by trial") in reason
    # switched on, off and to its choice between steps: the same training as without the hop
    assert trial["max_difference"] < 1e-9


def test_parallax_plan_runs_the_warmup_prints_and_writes_the_plan(tmp_path: Path) -> None:
    program = ROOT / "tests" / "scripts" / "faulty_worker.py"  # mode "export": plain training
    out = tmp_path / "plan.json"
    cmd = [sys.executable, "-m", "parallax.cli", "plan", "--machines", "2",
           "--nproc-per-machine", "1", "--warmup-steps", "3", "--json", str(out),
           str(program), "export", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "parallax plan (hybrid): 2 worker(s) on 2 machine(s)" in proc.stdout
    assert "predicted inter-machine bytes per machine and step" in proc.stdout
    assert "allreduce B/step" in proc.stdout and "optps B/step" in proc.stdout
    assert not (tmp_path / "export.pt").exists(), "plan must stop after the warm-up"
    plan = json.loads(out.read_text())
    assert set(plan["predicted_bytes"]) == {"hybrid", "allreduce", "ps", "optps"}
    assert all(v > 0 for v in plan["predicted_bytes"].values())
    sparse = [p for p in plan["parameters"] if p["sparse"]]
    assert {p["name"] for p in sparse} == {"embedding.weight", "bag.weight"}
    assert all(0 < p["alpha"] <= 1 for p in sparse)
    assert 0 < plan["alpha_model"] <= 1
    # the link is probed after the warm-up and the times are the bytes at its rate
    assert plan["link"]["source"].startswith("measured") and plan["link"]["bytes_per_s"] > 0
    assert plan["predicted_seconds"]["hybrid"] == pytest.approx(
        plan["predicted_bytes"]["hybrid"] / plan["link"]["bytes_per_s"])
    assert "hybrid link time/step" in proc.stdout and "predicted link time per step (the " \
        "bytes at the link" in proc.stdout
