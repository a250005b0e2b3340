"""The user's own loop under `parallax.distribute` on launched workers: outputs beyond the loss
equal the single-device program's for each worker's slice, and a rank that skips
``optimizer.step()`` is named on every rank (nothing hangs, nothing is left running).

The equivalence of the trained parameters through this surface is in tests/equivalence (the
``loop*`` cases)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from equivalence_cases import Case, Mixed, global_batches, loss_fn

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "scripts" / "own_loop_worker.py"


def run(mode: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess, float]:
    cmd = [sys.executable, "-m", "parallax.cli", "run", "--machines", "2",
           "--nproc-per-machine", "1", str(WORKER), mode, str(tmp_path)]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    return proc, time.monotonic() - start


def test_outputs_beyond_the_loss_equal_one_device_for_each_slice(tmp_path: Path) -> None:
    """An accuracy-style use of the outputs: every step's outputs on each worker equal the
    single-device model's outputs for the same rows, and so do the trained parameters."""
    proc, _ = run("outputs", tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    torch.manual_seed(0)
    model = Mixed().double()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    want = []
    for x, y in global_batches(Case("mixed", "adam", steps=4)):
        optimizer.zero_grad()
        output = model(x)
        want.append(output.detach().clone())
        loss_fn(output, y).backward()
        optimizer.step()
    per = want[0].shape[0] // 2
    for rank in range(2):
        got = torch.load(tmp_path / f"outputs-{rank}.pt")
        for step, (mine, full) in enumerate(zip(got, want, strict=True)):
            torch.testing.assert_close(mine, full[rank * per:(rank + 1) * per], rtol=1e-12,
                                       atol=1e-12, msg=f"rank {rank}, step {step + 1}")
    state = torch.load(tmp_path / "state.pt")
    for name, value in model.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-9, atol=1e-12, msg=name)
    # optimizer.state_dict(): the single-device one, server-held tables' moments included
    got, expected = torch.load(tmp_path / "optimizer.pt"), optimizer.state_dict()
    assert got["param_groups"] == expected["param_groups"]
    assert got["state"].keys() == expected["state"].keys()
    for index, entry in expected["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(got["state"][index][key], value, rtol=1e-9, atol=1e-12,
                                       msg=f"state[{index}][{key!r}]")


@pytest.mark.parametrize("mode, said", [
    ("skip-step", "rank 0 called optimizer.step() in step 3, rank 1 a forward of the model in "
                  "step 3"),
    ("save-on-0", "rank 0 called model.state_dict() in step 3, rank 1 a forward of the model "
                  "in step 3"),
])
def test_a_rank_that_leaves_the_common_sequence_is_named(tmp_path: Path, mode: str,
                                                         said: str) -> None:
    """Skipping optimizer.step() on one rank, or saving the (collective) state dict on rank 0
    alone as DDP programs do: every rank stops at once, naming what each called."""
    proc, seconds = run(mode, tmp_path)
    assert proc.returncode != 0
    summary = [line for line in proc.stderr.splitlines() if line.startswith("parallax: rank")]
    want = "UnsupportedProgramError: rank {r}: the ranks' training loops diverged: " + said
    for rank in range(2):
        assert any(want.format(r=rank) in line for line in summary), proc.stderr[-3000:]
    if mode == "save-on-0":  # the message says why: the state dict is collective
        assert proc.stderr.count("model.state_dict() is collective") >= 2, proc.stderr[-3000:]
    assert seconds < 60, "no rank waits for the collective timeout"
    for rank in range(2):
        pid = int((tmp_path / f"pid-{rank}").read_text())
        assert not Path(f"/proc/{pid}").exists(), f"rank {rank}'s process is still running"


def test_the_own_loop_example_trains_and_exports(tmp_path: Path) -> None:
    """examples/own_loop_lm.py (the README's migration example) on a small generated corpus,
    2 machines x 1 worker."""
    words = [f"w{(i * 7919) % 97}" for i in range(20_000)]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(" ".join(words[i:i + 20]) for i in range(0, len(words), 20)))
    cmd = [sys.executable, "-m", "parallax.cli", "run", "--machines", "2",
           "--nproc-per-machine", "1", str(ROOT / "examples" / "own_loop_lm.py"),
           "--corpus", str(corpus), "--max-steps", "5", "--vocab", "200"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "step 5: loss" in proc.stdout and "next-word accuracy" in proc.stdout
    assert "trained 5 steps; exported a plain state_dict of" in proc.stdout
