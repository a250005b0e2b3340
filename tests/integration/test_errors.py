"""Bad input and failing workers: clear errors naming the cause, nothing hangs, nothing left.

The distributed cases run the program of tests/scripts/faulty_worker.py under `parallax run` on
2 emulated machines with one worker each.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from equivalence_cases import Mixed, loss_fn
from torch import nn

import parallax
from parallax.cluster import ResourceError
from parallax.config import ConfigError
from parallax.engine.optimizers.shard_optimizer import OptimizerError
from parallax.engine.tables.server_table import SparseIdError

ROOT = Path(__file__).resolve().parents[2]
FAULTY = ROOT / "tests" / "scripts" / "faulty_worker.py"
COLLECTIVE_TIMEOUT_S = 60  # what faulty_worker.py configures


def run_faulty(mode: str, tmp_path: Path, machines: int = 2,
               ) -> tuple[subprocess.CompletedProcess, float]:
    cmd = [sys.executable, "-m", "parallax.cli", "run", "--machines", str(machines),
           "--nproc-per-machine", str(2 // machines), str(FAULTY), mode, str(tmp_path)]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    return proc, time.monotonic() - start


def assert_no_worker_left(tmp_path: Path) -> None:
    pids = [int(p.read_text()) for p in tmp_path.glob("pid-*")]
    assert len(pids) == 2, "both workers must have started"
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# ---- before any process starts ---------------------------------------------------------------
def test_unknown_config_field_is_named() -> None:
    with pytest.raises(ConfigError, match="Config has no field 'clip_norm'"):
        parallax.Config(clip_norm=1.0)
    with pytest.raises(ConfigError, match=r"unknown Config field\(s\) \['clip_norm'\]"):
        parallax.Config.from_dict({"clip_norm": 1.0})


@pytest.mark.parametrize("field, value", [
    ("clip_grad_norm", -1.0), ("clip_grad_norm", float("nan")), ("average_sparse", 1),
    ("num_partitions", 0), ("collective_timeout_s", 0), ("seed", "7"),
])
def test_inconsistent_config_values_are_named(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"Config.{field} must be"):
        parallax.Config(**{field: value})


def test_malformed_resource_file_fails_before_launch(tmp_path: Path) -> None:
    resources = tmp_path / "resources.txt"
    resources.write_text("# cluster\nlocalhost:0,1\nlocalhost:0,x\n")
    model = Mixed()
    with pytest.raises(ResourceError, match=r"resources.txt:3: .*localhost:0,x"):
        parallax.get_runner(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn,
                            resources=resources)


def test_optimizer_that_cannot_run_per_shard_fails_before_launch(tmp_path: Path) -> None:
    resources = tmp_path / "resources.txt"
    resources.write_text("localhost\nlocalhost\n")
    model = Mixed()
    with pytest.raises(OptimizerError, match=r"LBFGS .* sparse parameter 'embedding.weight'"):
        parallax.get_runner(model, torch.optim.LBFGS(model.parameters()), loss_fn,
                            resources=resources)


# ---- inside running workers ------------------------------------------------------------------
def test_out_of_range_id_fails_every_worker_naming_rank_and_parameter(tmp_path: Path) -> None:
    proc, seconds = run_faulty("bad_id", tmp_path)
    assert proc.returncode != 0
    assert "sparse parameter 'embedding.weight' got id 123456 on rank 1" in proc.stderr
    assert "outside its rows [0, 40)" in proc.stderr
    assert seconds < COLLECTIVE_TIMEOUT_S, "no worker may wait for the collective timeout"
    assert_no_worker_left(tmp_path)


def test_lbfgs_inside_workers_fails_with_the_cause(tmp_path: Path) -> None:
    proc, _ = run_faulty("lbfgs", tmp_path)
    assert proc.returncode != 0
    assert "optimizer LBFGS cannot be applied per shard" in proc.stderr
    assert_no_worker_left(tmp_path)


def test_workers_with_different_configs_or_models_fail_at_start_naming_them(
        tmp_path: Path) -> None:
    proc, seconds = run_faulty("mismatch", tmp_path)
    assert proc.returncode != 0
    assert ("workers disagree with rank 0: rank 1's Config differs in clip_grad_norm (1.0 vs "
            "None); rank 1's model differs in parameter(s) ['out.bias', 'out.weight']"
            ) in proc.stderr
    assert ("rank 1's parallax.partitioner groups differ ({'embedding.weight': ['tables', "
            "None]} vs {})") in proc.stderr
    # how they differ, and the habit that makes a model per rank (DLRM's WORLD_SIZE mode)
    assert "out.weight: " in proc.stderr and "vs rank 0's " in proc.stderr
    assert "from its rank or the world size" in proc.stderr
    assert seconds < COLLECTIVE_TIMEOUT_S
    assert_no_worker_left(tmp_path)


def test_nan_loss_on_one_worker_stops_every_worker_or_is_skipped_by_all(tmp_path: Path) -> None:
    proc, seconds = run_faulty("nan", tmp_path)
    assert proc.returncode != 0
    assert "step 3: NaN or infinite loss on rank(s) [1]" in proc.stderr
    assert "no parameter was updated" in proc.stderr and seconds < COLLECTIVE_TIMEOUT_S
    assert_no_worker_left(tmp_path)
    proc, _ = run_faulty("nan-skip", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [(tmp_path / f"skipped-{r}").read_text() for r in range(2)] == ["1", "1"]


def test_one_failing_worker_ends_all_and_launcher_names_it(tmp_path: Path) -> None:
    proc, seconds = run_faulty("raise", tmp_path)
    assert proc.returncode != 0
    assert "rank 1" in proc.stderr and "deliberate failure" in proc.stderr
    assert seconds < COLLECTIVE_TIMEOUT_S, "the others must not wait for the timeout"
    assert_no_worker_left(tmp_path)


def test_one_failing_asynchronous_worker_ends_all_at_once(tmp_path: Path) -> None:
    """Under sync="async" nothing collective holds the others: the failing worker must not
    keep serving them until they finish, and they must not wait for a timeout."""
    proc, seconds = run_faulty("raise-async", tmp_path)
    assert proc.returncode != 0
    assert "rank 1" in proc.stderr and "deliberate failure" in proc.stderr
    assert seconds < FAULT_TIMEOUT_S, "the others must not wait for the timeout"
    assert_no_worker_left(tmp_path)


def test_a_staleness_wait_names_the_worker_that_hangs(tmp_path: Path) -> None:
    proc, seconds = run_faulty("hang-async", tmp_path)
    assert proc.returncode != 0
    assert re.search(r"rank 0 waited 8 s .* before step \d+: with max_staleness=1 .* "
                     r"but rank 1 finished 3", proc.stderr), proc.stderr[-3000:]
    assert seconds < 120, "the failure must come from the timeout, not the sleep's end"
    assert_no_worker_left(tmp_path)


# faulty_worker.py's collective timeout in modes uneven and raise-async (8 s in hang*): far
# above what a run that does not wait for it takes on 2 loaded cores (15-26 s seen)
FAULT_TIMEOUT_S = 60
HANG_TIMEOUT_S = 8


@pytest.mark.parametrize("machines", [1, 2])
def test_uneven_inputs_name_the_rank_that_ended_and_fail_at_once(tmp_path: Path,
                                                                 machines: int) -> None:
    proc, seconds = run_faulty("uneven", tmp_path, machines)
    assert proc.returncode != 0
    summary = [line for line in proc.stderr.splitlines() if line.startswith("parallax: rank")]
    assert summary and summary[0].startswith(
        f"parallax: rank 1 (machine {machines - 1}) failed: exit code 1: UnevenInputsError: "
        "rank 0 ended its training after 3 step(s); rank 1 called step 4 — give every worker "
        "the same number of batches"), proc.stderr[-3000:]
    assert "remote worker crashing" not in summary[0]
    assert seconds < FAULT_TIMEOUT_S, "nobody waits for the collective timeout"
    assert_no_worker_left(tmp_path)


@pytest.mark.parametrize("mode, where", [
    ("hang", r"finished step 3, (?:[89]|1[0-9])\.[0-9] s ago — it has not called step 4"),
    ("hang-loss", r"step 4 \(forward\), (?:[89]|1[0-9])\.[0-9] s ago — it has not finished the "
                  "forward of step 4"),
])
def test_a_hung_rank_is_named_not_the_rank_whose_wait_expired(tmp_path: Path, mode: str,
                                                              where: str) -> None:
    proc, seconds = run_faulty(mode, tmp_path)
    assert proc.returncode != 0
    summary = [line for line in proc.stderr.splitlines() if line.startswith("parallax: rank")]
    assert summary[0].startswith("parallax: rank 1 (machine 1) stopped responding; rank 0 "
                                 "timed out waiting for it: StalledRankError: rank 1 did not "
                                 "arrive"), proc.stderr[-3000:]
    assert re.search(f"rank 1's last record is: {where}", proc.stderr), proc.stderr[-3000:]
    assert not any(line.startswith("parallax: rank 0") for line in summary)
    assert seconds < HANG_TIMEOUT_S + 42, "every process ends soon after the timeout"
    assert_no_worker_left(tmp_path)


def test_exported_state_dict_loads_into_original_class_and_reproduces_outputs(
        tmp_path: Path) -> None:
    proc, _ = run_faulty("export", tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    outputs = torch.load(tmp_path / "export.pt")
    torch.testing.assert_close(outputs["single"], outputs["distributed"], rtol=0, atol=0)


def test_lazy_updates_with_an_optimizer_without_sparse_gradients_fail_before_launch(
        tmp_path: Path) -> None:
    resources = tmp_path / "resources.txt"
    resources.write_text("localhost\nlocalhost\n")
    model = Mixed()
    with pytest.raises(OptimizerError, match=r"lazy_sparse_updates.*'embedding.weight'.*Adam"):
        parallax.get_runner(model, torch.optim.Adam(model.parameters()), loss_fn,
                            resources=resources,
                            config=parallax.Config(lazy_sparse_updates=True))


def test_negative_id_is_named_and_nothing_is_updated() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 3), nn.Flatten(), nn.Linear(6, 1))
    runner = parallax.get_runner(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                 nn.functional.mse_loss)
    try:
        before = {k: v.clone() for k, v in runner.state_dict().items()}
        with pytest.raises(SparseIdError, match=r"'0.weight' got id -3 on rank 0.*\[0, 10\)"):
            runner.step((torch.tensor([[1, -3]]), torch.zeros(1, 1)))
        after = runner.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
    finally:
        parallax.shutdown()


def test_every_public_error_is_exported_under_one_base() -> None:
    from parallax import errors
    from parallax.checkpoint.files import CheckpointError
    from parallax.engine.tables.exchange import SparseIdError as RaisedByTheHop

    for name in errors.__all__:
        cls = getattr(parallax, name)
        assert cls is getattr(errors, name) and name in parallax.__all__
        if name not in ("PlanComplete", "VerifyComplete"):  # ends a run: a SystemExit
            assert issubclass(cls, parallax.ParallaxError), name
    for ending in (parallax.PlanComplete, parallax.VerifyComplete):
        assert not issubclass(ending, Exception)  # `except Exception` lets it pass
    assert RaisedByTheHop is parallax.SparseIdError and CheckpointError is parallax.CheckpointError
    assert issubclass(parallax.ConfigError, ValueError)  # still the built-in it specialises
    with pytest.raises(parallax.ParallaxError, match="Config.clip_grad_norm must be"):
        parallax.Config(clip_grad_norm=-1.0)
