"""``parallax verify`` on the demo and on two example programs: equal programs exit 0, a
planted divergence (examples/uneven_epoch.py: the epoch's padded last step) exits 1 naming
the step and the tensors, with the hint that explains it. Its fix (``drop_last=True``) reads
the same global batches in both runs: tests/unit/test_verify_parts.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    words = [f"w{(i * 7919) % 97}" for i in range(8_000)]
    path = tmp_path_factory.mktemp("verify") / "corpus.txt"
    path.write_text("\n".join(" ".join(words[i:i + 20]) for i in range(0, len(words), 20)))
    return path


def verify(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "parallax.cli", "verify", *args],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_the_demo_verifies_equal(corpus: Path) -> None:
    """The README's main job (a get_runner program): its one-worker run is the reference."""
    proc = verify("--steps", "4", "examples/train_lm.py", "--corpus", str(corpus),
                  "--vocab", "200", "--max-valid-batches", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "EQUAL: every parameter and buffer within 1e-09" in proc.stdout
    assert "reference: the program's one-worker run" in proc.stdout
    assert "embedding.weight" in proc.stdout and "at each of 4 step(s)" in proc.stdout


def test_the_own_loop_example_verifies_equal_against_plain_pytorch(corpus: Path,
                                                                   tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    proc = verify("--steps", "4", "--json", str(report), "examples/own_loop_lm.py",
                  "--corpus", str(corpus), "--vocab", "200")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "reference: plain PyTorch" in proc.stdout
    result = json.loads(report.read_text())
    assert result["equal"] and result["steps"] == 4
    assert {t["name"] for t in result["tensors"]} >= {"embedding.weight", "decoder.weight"}
    assert all(t["max_difference"] <= 1e-9 for t in result["tensors"])


def test_a_planted_divergence_is_named_with_its_step_and_cause(tmp_path: Path) -> None:
    """101 samples on 2 workers: DistributedSampler pads the last of 7 steps per epoch."""
    report = tmp_path / "report.json"
    proc = verify("--steps", "8", "--json", str(report), "examples/uneven_epoch.py")
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert "DIFFERENT: 7 of 7 tensors went above 1e-09; the first at step 7" in proc.stdout
    assert "hint: a sharded loader's dataset has 101 samples" in proc.stdout
    result = json.loads(report.read_text())
    assert not result["equal"]
    firsts = {t["name"]: t["first_step_above"] for t in result["tensors"]}
    assert firsts == dict.fromkeys(firsts, 7) and "history.weight" in firsts


def test_a_ports_own_mistake_shows_against_the_original_program() -> None:
    """A schedule sized from the loader before parallax.shard (W times the worker's steps)
    trains the same in the port's one-process reference (on 26b56e5 verify said EQUAL):
    against the original single-device program (--reference) it differs from step 2, after
    the initial state and the first update (the schedule's factor 1 in both) compared equal:
    the original ran with the global batch, from the same values, on the same data. (The
    README's port, shard where the loader is made, verifies EQUAL against it: run by hand,
    session of 2026-12-01.)"""
    original = "tests/scripts/schedule_original.py"
    proc = verify("--machines", "1", "--nproc-per-machine", "2", "--steps", "4",
                  "--reference", original, "tests/scripts/schedule_port.py",
                  "--sized-before-shard")
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert f"reference: the original program {original} (no parallax)" in proc.stdout
    assert "DIFFERENT: 3 of 3 tensors went above 1e-09; the first at step 2" in proc.stdout


def test_a_program_trained_twice_in_one_process_verifies_each_run() -> None:
    """A program that trains, then trains again in the same process (a notebook cell run
    again): each run's model is compared with its own one-process reference, both equal."""
    proc = verify("--machines", "1", "--nproc-per-machine", "2", "--steps", "20",
                  "tests/scripts/two_runs.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout.count("EQUAL: every parameter and buffer within 1e-09 of the "
                             "one-process run at each of 8 step(s)") == 2, proc.stdout
    assert "model 2 (the program's call 2 of parallax.distribute" in proc.stdout
