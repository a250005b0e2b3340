"""The experiment scripts beyond compare.py's tables run end to end at tiny sizes, as
test_benchmarks.py runs the others (its helpers; a file of its own so that the suite's two
pytest processes, ``--dist loadfile``, share the harness's smoke runs): time to quality, the
partition search, Slim-DP, model parallelism, launch overhead, the chaos soak."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from unittest.mock import patch

import pytest
from test_benchmarks import BENCH, ROOT, run_script


def test_time_to_quality_takes_the_nmt_with_its_held_out_pairs() -> None:
    """``--workload nmt``: its own defaults, and each launch's workload holds out the pairs
    it validates on (the run itself is the LM's smoke below: the same code path)."""
    sys.path.insert(0, str(BENCH))
    import compare
    import time_to_quality as ttq

    args = ttq.parse_args(["--workload", "nmt", "--seeds", "4"])
    assert (args.batch, args.validation_windows, args.name) == (
        32, 512, "time-to-quality-nmt-2x2")
    launch = ttq.compare_args(args, "1gbit", 4)
    assert launch.workload == "nmt" and launch.batch == 32
    assert compare.workload_options(launch)["held_out"] == ttq.NMT_HELD_OUT >= 512
    assert compare.workload_options(launch)["seed"] == 4
    assert ttq.parse_args([]).target == 6.88  # the LM's, unchanged


@pytest.mark.network  # fetches the KJV (Debian sword-text-kjv) on first use
def test_time_to_quality_on_real_text(tmp_path: Path) -> None:
    """The KJV LM trained to a validation target by two systems: both start from the same
    validation loss (same weights, same held-out windows), reach the target at the same
    evaluation, and the hybrid keeps both tables on its servers (they are sparse)."""
    run_script("time_to_quality.py", "--machines", "2", "--nproc-per-machine", "1",
               "--rates", "1gbit", "--seeds", "1", "--systems", "hybrid", "ddp-sparse",
               "--target", "9.3", "--eval-every", "3", "--max-steps", "6",
               "--validation-windows", "32", "--name", "ttq", "--out-dir", str(tmp_path))
    data = json.loads((tmp_path / "ttq.json").read_text())
    runs = {r["system"]: r for r in data["runs"]}
    assert set(runs) == {"hybrid", "ddp-sparse"} and len(data["provenance"]["commit"]) == 40
    for run in runs.values():
        assert run["seed"] == 1 and run["rate"] == "1gbit" and run["reached"], run
        curve = run["curve"]
        assert [p["step"] for p in curve] == list(range(0, run["steps_to_target"] + 1, 3))
        assert curve[0]["seconds"] == 0 and curve[-1]["seconds"] == run["seconds_to_target"] > 0
        assert curve[-1]["validation_loss"] <= 9.3 < curve[0]["validation_loss"], curve
    assert runs["hybrid"]["curve"][0]["validation_loss"] == pytest.approx(
        runs["ddp-sparse"]["curve"][0]["validation_loss"], rel=1e-6)
    assert runs["hybrid"]["steps_to_target"] == runs["ddp-sparse"]["steps_to_target"]
    assert runs["hybrid"]["synced_by"] == {"embedding.weight": "ps", "softmax.weight": "ps"}
    assert "| 1gbit | hybrid | " in (tmp_path / "ttq.md").read_text()
    assert (tmp_path / "ttq.png").stat().st_size > 1000


def test_partitions_smoke(tmp_path: Path) -> None:
    """Table 2/5 analog: brute force over counts, then the in-process search on a fresh runner;
    the verdict compares the searched count's brute-force time with the best."""
    run_script("partitions.py", "--machines", "2", "--nproc-per-machine", "1", "--partitions",
               "1", "2", "4", "--steps", "2", "--settle", "1", "--rounds", "2",
               "--search-steps", "2", "--alpha-steps", "1", "--vocab", "2000",
               "--out-dir", str(tmp_path))
    name = "partitions-lm-2x1-1gbit-search2"  # not the default sample length
    data = json.loads((tmp_path / f"{name}.json").read_text())
    assert [r["partitions"] for r in data["brute_force"]] == [1, 2, 4]
    assert all(r["median_step_s"] > 0 and len(r["step_times_s"]) == 4  # 2 rounds x 2 steps
               for r in data["brute_force"])
    search = data["search"]
    assert search["source"] == "searched" and search["samples"][0]["partitions"] == 2
    assert set(search["tables"]) == {"embedding.weight", "softmax.weight"}
    verdict = data["verdict"]
    assert verdict["chosen_partitions"] in (1, 2, 4) and verdict["chosen_over_best"] >= 1
    assert verdict["samples"] == len(search["samples"]) <= 3
    brute = {r["partitions"]: r["median_step_s"] for r in data["brute_force"]}
    assert verdict["worst_step_s"] == max(brute.values()) >= verdict["best_step_s"]
    assert brute[verdict["worst_partitions"]] == verdict["worst_step_s"]
    text = (tmp_path / f"{name}.md").read_text()
    assert "Searched P's brute-force time / best" in text and "Table 5: brute force's" in text
    assert (tmp_path / f"{name}.png").stat().st_size > 0


def test_slim_dp_ablation_modes_are_the_papers_and_valid_configs(tmp_path: Path) -> None:
    """`slim_dp.py --ablation`: q beyond the run, beta = 0, beta = alpha and a sweep of c, each
    a Config the engine accepts; --vary-seeds gives each repeat its own seed."""
    sys.path.insert(0, str(BENCH))
    import slim_dp
    import slim_dp_worker

    args = slim_dp.parse_args(["--ablation", "--steps", "600", "--vary-seeds"])
    modes = {m["label"]: m for m in slim_dp.modes_of(args)}
    assert list(modes) == ["plump", "slim", "slim q>run", "slim b=0", "slim b=a", "slim c=0",
                           "slim c=0.5", "slim c=4"]
    configs = {label: slim_dp_worker.config_of(mode).slim for label, mode in modes.items()}
    assert configs["slim q>run"].reselect_every == 601  # no full round in 600 steps
    assert configs["slim b=0"].beta == 0 and configs["slim b=a"].beta == configs["slim b=a"].alpha
    assert [configs[f"slim c={c}"].significance for c in ("0", "0.5", "4")] == [0, 0.5, 4]
    launched = []

    def run(cmd: list[str], check: bool) -> None:  # the launch, without training
        launched.append(json.loads(cmd[-1]))
        Path(launched[-1]["out"]).write_text("[]")

    with patch.object(slim_dp.subprocess, "run", run):
        slim_dp.launch(args, 4, "1gbit", 2, tmp_path / "launch.json")
    assert launched[0]["seed"] == 2 and launched[0]["order_shift"] == 2
    # --regime (issue 74 item 5): Quant-DP beside, q beyond the run, the paper's beta and
    # alpha; --first-seed splits a run's seeds over sittings
    regime = slim_dp.parse_args(["--regime", "--steps", "3000", "--vary-seeds",
                                 "--first-seed", "3"])
    modes = {m["label"]: slim_dp_worker.config_of(m) for m in slim_dp.modes_of(regime)}
    assert list(modes) == ["plump", "quant", "slim a=0.3 b=0", "slim a=0.3 b=0.15",
                           "slim a=0.3 b=0.3", "slim a=0.1 b=0.05", "slim a=0.2 b=0.1",
                           "slim a=0.5 b=0.25"]
    assert modes["quant"].qsgd is not None
    assert all(c.slim.reselect_every == 3001 for label, c in modes.items()
               if label.startswith("slim"))
    with patch.object(slim_dp.subprocess, "run", run):
        slim_dp.launch(regime, 4, "3gbit", 1, tmp_path / "launch.json")
    assert launched[-1]["seed"] == 4


@pytest.mark.network  # may fetch Fashion-MNIST (Debian package) on first use
def test_slim_dp_smoke(tmp_path: Path) -> None:
    """The Slim-DP tables' harness: every mode trains, times split into computation and
    communication, speeds normalised to Plump-DP, Quant-DP and Slim-DP moving fewer bytes."""
    run_script("slim_dp.py", "--machines", "2", "--rates", "1gbit", "--steps", "4",
               "--eval-every", "2", "--repeats", "1", "--eval-size", "200", "--out-dir",
               str(tmp_path))
    data = json.loads((tmp_path / "slim_dp.json").read_text())
    assert len(data["provenance"]["commit"]) == 40
    rows = data["summary"]["K=2, 1gbit"]
    assert set(rows) == {"plump-ar", "plump", "quant-ar", "quant", "slim"}
    for label, row in rows.items():
        assert row["comm_s"] > 0 and row["comp_s"] > 0, label
        assert row["comp_s"] + row["comm_s"] == pytest.approx(row["train_s"]), label
        assert 0 < row["check_s"] < row["comp_s"], label  # the check's share of comp
        assert [p["step"] for p in row["curve"]] == [2, 4], label
        assert 0 <= row["final_accuracy"] <= 1, label
        assert row["wire_bytes_per_step_machine"] > 0, label
    assert rows["plump"]["speed_d"] == 1.0
    plump = rows["plump"]["engine_bytes_per_step_rank0"]
    assert rows["quant"]["engine_bytes_per_step_rank0"] < 0.7 * plump
    assert rows["slim"]["engine_bytes_per_step_rank0"] < 0.3 * plump  # (2α-β)n + αn of 2n
    assert "| slim |" in (tmp_path / "slim_dp.md").read_text()
    assert (tmp_path / "slim_dp.png").stat().st_size > 0
    # the tables again from the raw records alone, the run's provenance kept
    (tmp_path / "slim_dp.md").unlink()
    run_script("slim_dp.py", "--from-json", str(tmp_path / "slim_dp.json"), "--no-plot")
    again = json.loads((tmp_path / "slim_dp.json").read_text())
    assert again["provenance"] == data["provenance"] and again["summary"] == data["summary"]
    assert "| slim |" in (tmp_path / "slim_dp.md").read_text()


def test_model_parallel_smoke(tmp_path: Path) -> None:
    """The strong-scaling harness (the report's Figures 5-7): every grid of P trains the same
    model (equal final MSE), each record has its measured and predicted times, bytes per
    communicator and the grid ``auto`` picks, and the figure is drawn. Run over this host's
    unshaped loopback (``--rate none``) with every layer gathered (the report's scheme)."""
    run_script("model_parallel.py", "--data", "synthetic", "--rows", "2000", "--widths", "16",
               "--processes", "1", "2", "--steps", "4", "--warmup", "1", "--replay", "2",
               "--rate", "none", "--model-split", "every-layer", "--out-dir", str(tmp_path))
    stem = "model_parallel-synthetic-none-every-layer"
    data = json.loads((tmp_path / f"{stem}.json").read_text())
    assert data["options"]["model_split"] == "every-layer"
    assert len(data["provenance"]["commit"]) == 40
    rows = {(r["P"], r["grid"]): r for r in data["rows"]}
    assert set(rows) == {(1, "1x1"), (2, "2x1"), (2, "1x2")}
    mse = {r["final_mse"] for r in rows.values()}
    assert max(mse) - min(mse) < 1e-5, mse  # every grid trains the global batch
    assert rows[(2, "2x1")]["data_bytes"] > 0 and rows[(2, "2x1")]["model_bytes"] == 0
    assert rows[(2, "1x2")]["model_bytes"] > 0 and rows[(2, "1x2")]["data_bytes"] == 0
    for row in rows.values():
        assert row["wall_ms"] > 0 and row["predicted_ms"] > 0 and row["compute_ms"] > 0
    assert [a["auto"] in ("2x1", "1x2") for a in data["auto"]] == [True]
    table = (tmp_path / f"{stem}.md").read_text()
    assert "| 16 | 2 | 1x2 | model |" in table and "model split every-layer" in table
    assert (tmp_path / f"{stem}.png").stat().st_size > 0


def test_launch_overhead_smoke(tmp_path: Path) -> None:
    """launch_overhead.py: the parts of a launch are measured, positive, and add up to it;
    its CPU seconds (every process of the launch) are counted beside them."""
    out = tmp_path / "launch.json"
    run_script("launch_overhead.py", "--nproc-per-machine", "1", "--repeats", "1", "--no-warm-up",
               "--label", "smoke", "--out", str(out))
    (record,) = json.loads(out.read_text())
    parts = record["parts"]
    assert record["label"] == "smoke" and len(record["provenance"]["commit"]) == 40
    named = [name for name in parts if name not in ("total", "cpu")]
    assert all(parts[name]["median_s"] > 0 for name in parts), parts
    assert sum(parts[name]["median_s"] for name in named) == pytest.approx(
        parts["total"]["median_s"], rel=1e-9)  # one repeat: the medians are its parts


def test_chaos_smoke(tmp_path: Path) -> None:
    """The chaos soak's fast version (fixed seeds): a SIGKILLed rank resumed by a restart ends
    equal to the uninterrupted run; without restarts the launcher names the rank and its
    signal, exits 137 and leaves no process behind."""
    out = tmp_path / "chaos.json"
    run_script("chaos.py", "--trials", "1", "--kinds", "kill", "kill-norestart", "--steps",
               "10", "--checkpoint-every", "3", "--step-sleep", "0.05", "--out", str(out))
    trials = {t["kind"]: t for t in json.loads(out.read_text())["trials"]}
    assert trials["kill"]["outcome"] == "survived", trials["kill"]
    killed = trials["kill-norestart"]
    assert killed["outcome"] == "failed-clearly" and killed["exit_code"] == 137, killed
    assert all(killed["checks"].values()), killed["checks"]
    assert "| kill | 1 (0) | 1 | 0 | 0 | 0 |" in out.with_suffix(".md").read_text()


def test_chaos_combine_joins_sittings_of_one_engine_and_refuses_two(tmp_path: Path) -> None:
    """`chaos.py --combine`: the trials of records from the same src/ tree become one table;
    records of different (or modified) engines are refused, so a table never mixes them."""
    def record(name: str, tree: str, seeds: range) -> Path:
        path = tmp_path / name
        path.write_text(json.dumps({
            "settings": {}, "code": {"commit": "c", "src_tree": tree, "src_modified": "False"},
            "trials": [{"kind": "kill", "seed": s, "outcome": "survived"} for s in seeds]}))
        return path

    first, second = record("a.json", "t1", range(3)), record("b.json", "t1", range(3, 5))
    out = tmp_path / "all.json"
    run_script("chaos.py", "--combine", str(first), str(second), "--out", str(out))
    joined = json.loads(out.read_text())
    assert [t["seed"] for t in joined["trials"]] == [0, 1, 2, 3, 4]
    assert "| kill | 5 (0) | 5 | 0 | 0 | 0 |" in out.with_suffix(".md").read_text()
    other = record("c.json", "t2", range(5, 6))
    proc = subprocess.run([sys.executable, str(BENCH / "chaos.py"), "--combine", str(first),
                           str(other), "--out", str(tmp_path / "mixed.json")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode != 0 and "different (or modified) engines" in proc.stderr
    assert not (tmp_path / "mixed.json").exists()
