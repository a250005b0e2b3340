"""Asynchronous training (`Config.sync` "async" / "async-sparse"), on 2 machines x 2 workers
(tests/scripts/async_worker.py): max_staleness=0 equals the single-device program; no push is
lost however the workers interleave; a 3x straggler does not hold back the others without a
bound and holds them back exactly as far as the bound says with one; a checkpoint is one
consistent snapshot; a non-finite push is dropped on its worker alone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "scripts"))
import async_worker  # noqa: E402

MODES = ["async-sparse", "async"]


def failure(stderr: str) -> str:
    """The job's first traceback (the cause) and its last lines (the launcher's summary): a
    failing rank's peers write long tracebacks of their timeouts after it."""
    first = stderr.find("Traceback")
    head = stderr[first:first + 4000] if first >= 0 else ""
    return f"{head}\n...\n{stderr[-3000:]}"


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("async")
    cmd = [sys.executable, "-m", "parallax.cli", "run", "--machines", "2",
           "--nproc-per-machine", "2", str(ROOT / "tests" / "scripts" / "async_worker.py"),
           str(folder / "out.pt"), str(folder / "checkpoint")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, failure(proc.stderr)
    return torch.load(folder / "out.pt")


@pytest.mark.parametrize("optimizer", sorted(async_worker.OPTIMIZERS))
@pytest.mark.parametrize("mode", MODES)
def test_max_staleness_zero_equals_the_single_device_program(trained, mode, optimizer) -> None:
    single = trained[f"single/{optimizer}"]
    result = trained[f"k0/{mode}/{optimizer}"]
    assert result.keys() == single.keys()
    for name, value in result.items():
        torch.testing.assert_close(value, single[name], rtol=0, atol=1e-9, msg=name)


@pytest.mark.parametrize("mode", MODES)
def test_no_push_is_lost(trained, mode) -> None:
    lost = trained[f"lost/{mode}"]
    assert lost["pushed"].abs().sum() > 0
    # what the servers applied is every worker's pushed rows, exactly (integers)
    assert torch.equal(lost["applied"], lost["pushed"])
    # SGD with lr 1: the table is its initial values minus every push
    assert torch.equal(lost["final"]["embedding.weight"],
                       lost["initial"]["embedding.weight"] - lost["pushed"])
    assert torch.equal(lost["final"]["scale"], lost["initial"]["scale"] - lost["pushed_scale"])


def test_a_straggler_does_not_slow_the_others_without_a_bound(trained) -> None:
    result = trained["straggler/None"]
    straggler_done = result[:-1, 3]
    # each fast worker finished its last step while the straggler (3x the sleep a step) was
    # more steps behind than the bound-2 run lets it be: an order of events, not a wall-time
    # ratio, so a slow host's per-step overhead does not change it
    lead = async_worker.STRAGGLER_STEPS - straggler_done
    assert (lead > 2).all(), straggler_done


def test_a_staleness_bound_holds_the_others_back_exactly_as_far_as_it_says(trained) -> None:
    bound = 2
    result = trained[f"straggler/{bound}"]
    times, lags, waited = result[:, 0], result[:, 1], result[:, 2]
    # no worker ever began a step more than `bound` steps ahead of the slowest, and the fast
    # ones reached the bound (they waited)
    assert lags.max() == bound
    assert (lags[:-1] == bound).all() and (waited[:-1] > 0).all()
    # a fast worker's last step had to wait for the straggler's step STEPS - 1 - bound,
    # which took at least that many of its 3 x BASE steps
    least = (async_worker.STRAGGLER_STEPS - 1 - bound) * 3 * async_worker.BASE
    assert times[:-1].min() >= least, times


def test_a_checkpoint_is_one_consistent_snapshot(trained) -> None:
    snapshot = trained["snapshot"]
    assert snapshot["step"] == 6
    for name, value in snapshot["at_save"].items():
        assert torch.equal(snapshot["loaded"][name], value), name


def test_a_nonfinite_push_is_dropped_on_its_worker_alone(trained) -> None:
    skipped = trained["skip"]
    assert skipped["skipped"] == 1  # rank 1's, once
    for name, value in skipped["state"].items():
        assert torch.isfinite(value).all(), name


def test_the_users_own_loop_trains_asynchronously_too(trained) -> None:
    single = trained["single/adam"]
    for name, value in trained["own_loop"].items():
        torch.testing.assert_close(value, single[name], rtol=0, atol=1e-9, msg=name)


@pytest.mark.parametrize("sync", ["async", "async-sparse"])
def test_the_main_job_trains_asynchronously(tmp_path, sync) -> None:
    """examples/train_lm.py --sync: the progress counts every worker's words, evaluation,
    the plan and the export work on asynchronous servers."""
    corpus = tmp_path / "corpus.txt"
    words = [f"w{i % 97}" for i in range(4000)]
    corpus.write_text("\n".join(" ".join(words[i:i + 12]) for i in range(0, 4000, 12)))
    cmd = [sys.executable, "-m", "parallax.cli", "run", "--machines", "2",
           "--nproc-per-machine", "1", str(ROOT / "examples" / "train_lm.py"),
           "--corpus", str(corpus), "--sync", sync, "--max-steps", "6",
           "--max-valid-batches", "2", "--vocab", "200", "--seq-len", "10"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, failure(proc.stderr)
    assert "words/s on 2 workers; validation perplexity" in proc.stdout
    assert "exported a plain state_dict" in proc.stdout


def test_workers_end_on_their_own_clocks_and_no_push_is_lost(tmp_path) -> None:
    """Ranks (servers among them) finish after different numbers of steps and exit while
    others train: the bound ignores finished workers, finished servers keep serving, every
    push is applied (one update per push on every server)."""
    sys.path.insert(0, str(ROOT / "tests" / "scripts"))
    import async_uneven_worker

    cmd = [sys.executable, "-m", "parallax.cli", "run", "--machines", "2",
           "--nproc-per-machine", "2", str(ROOT / "tests" / "scripts" /
                                           "async_uneven_worker.py"), str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, failure(proc.stderr)
    pushes = sum(async_uneven_worker.STEPS.values())
    for server in (0, 2):
        assert int((tmp_path / f"updates-{server}").read_text()) == pushes
