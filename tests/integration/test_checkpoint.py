"""Checkpoints (issue 6): sharded, atomic, resumable on another cluster shape and partition
count, with the data stream and optimizer state; bad checkpoints named, never half-loaded."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from equivalence_cases import Mixed, clip_like_parallax, loss_fn
from torch import nn

import parallax
from parallax.checkpoint import files as checkpoint_files
from parallax.checkpoint.files import CheckpointError

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "scripts" / "checkpoint_worker.py"
sys.path.insert(0, str(WORKER.parent))
import checkpoint_worker  # noqa: E402


def reference(steps: int, optimizer: str = "adam") -> dict[str, torch.Tensor]:
    """The single-device program's parameters after ``steps``."""
    return reference_program(steps, optimizer)[0].state_dict()


def reference_program(steps: int, optimizer: str = "adam",
                      ) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The single-device program: global batches of 12 in the data set's order."""
    model, optimizer = checkpoint_worker.build(optimizer)
    ids, targets = checkpoint_worker.dataset().tensors
    batch = checkpoint_worker.GLOBAL_BATCH
    for k in range(steps):
        optimizer.zero_grad()
        loss_fn(model(ids[k * batch:(k + 1) * batch]), targets[k * batch:(k + 1) * batch]
                ).backward()
        clip_like_parallax(list(model.parameters()), 0.05)
        optimizer.step()
    return model, optimizer


def assert_same(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name, value in want.items():
        difference = float((got[name] - value).abs().max() / value.abs().max())
        assert difference < 1e-9, (name, difference)


def run(shape: tuple[int, int], *args: str, restarts: int = 0, timeout: int = 300,
        ) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "parallax.cli", "run", "--machines", str(shape[0]),
           "--nproc-per-machine", str(shape[1])]
    if restarts:
        cmd += ["--max-restarts", str(restarts)]
    return subprocess.run([*cmd, str(WORKER), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


# ---- across processes ----------------------------------------------------------------------
def test_resume_on_other_shapes_and_partition_counts(tmp_path: Path) -> None:
    """Six steps on 2x2 (default partitions), then the rest on 1x3 with 5 partitions and on
    2x1 with 3: both equal ten single-device steps (data position, Adam state and all). The
    2x2 and 1x3 processes first train two other programs to their end and keep them alive
    (a sweep, a notebook): the checkpoint holds this program's loader alone. On 26b56e5 it
    held three positions and the resume gave the first (an earlier program's) to this
    program's loader: 0.29 apart, no error."""
    saved = tmp_path / "2x2"
    proc = run((2, 2), str(saved), "6", "-", "--trained-before")
    assert proc.returncode == 0, proc.stderr[-4000:]
    manifest = checkpoint_files.read_manifest(checkpoint_files.newest_complete(saved))
    assert manifest.step == 6 and manifest.meta["cluster"] == {"machines": 2, "world_size": 4}
    assert manifest.meta["data"] == [{"epoch": 0, "samples": 72}]
    assert manifest.meta["data_loaders"] == [
        {"dataset": "TensorDataset", "samples": 120, "order": "sequential"}]
    assert sorted(manifest.meta["tables"]["embedding.weight"]["files"]) == [
        "tables/embedding.weight/server-0.pt", "tables/embedding.weight/server-1.pt"]
    want = reference(10)
    for shape, partitions in (((1, 3), "5"), ((2, 1), "3")):
        directory = tmp_path / f"{shape[0]}x{shape[1]}"
        shutil.copytree(saved, directory)
        out = tmp_path / f"out-{shape[0]}x{shape[1]}.pt"
        before = ["--trained-before"] if shape == (1, 3) else []
        proc = run(shape, str(directory), "10", str(out), partitions, *before)
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert "parallax: resumed from step 6" in proc.stderr
        assert_same(torch.load(out), want)


def test_resume_under_another_architecture(tmp_path: Path) -> None:
    """Six hybrid steps, then the rest under ps (the dense layers move onto the servers: read
    from the checkpoint's dense part) and under allreduce (the tables become replicas): both
    equal ten single-device steps."""
    saved = tmp_path / "hybrid"
    proc = run((2, 1), str(saved), "6", "-")
    assert proc.returncode == 0, proc.stderr[-4000:]
    want = reference(10)
    for architecture in ("ps", "allreduce"):
        directory = tmp_path / architecture
        shutil.copytree(saved, directory)
        out = tmp_path / f"out-{architecture}.pt"
        proc = run((2, 1), str(directory), "10", str(out), "--architecture", architecture)
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert "parallax: resumed from step 6" in proc.stderr
        assert_same(torch.load(out), want)


def test_a_restart_resumes_a_killed_worker_and_its_data_position(tmp_path: Path) -> None:
    """SIGKILL of rank 1 in step 5, one restart: the job resumes from step 4 (the sharded
    loader's position too) and ends exactly where an uninterrupted run does. Without restarts
    (the rank named, exit 137, nothing left behind): benchmarks/chaos.py's kill-norestart,
    tests/benchmarks/test_benchmarks.py::test_chaos_smoke."""
    out = tmp_path / "out.pt"
    proc = run((2, 1), str(tmp_path / "restart"), "10", str(out), "--kill-at", "5",
               restarts=1)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "parallax: resumed from step 4" in proc.stderr
    assert_same(torch.load(out), reference(10))


# ---- in one process --------------------------------------------------------------------------
def single_runner(directory: Path, optimizer: str = "adam", **config) -> parallax.Runner:
    model, optimizer = checkpoint_worker.build(optimizer)
    # alpha_threshold=1.0 (α never exceeds it): the tables stay on the servers, which one
    # worker would otherwise replicate after the warm-up
    return parallax.get_runner(model, optimizer, loss_fn, config=parallax.Config(
        clip_grad_norm=0.05, checkpoint_dir=str(directory), collective_timeout_s=30,
        **{"alpha_threshold": 1.0, **config}))


def batches(start: int, stop: int):
    ids, targets = checkpoint_worker.dataset().tensors
    return [(ids[k * 12:(k + 1) * 12], targets[k * 12:(k + 1) * 12]) for k in range(start, stop)]


def test_save_load_round_trip_with_extra_and_export(tmp_path: Path) -> None:
    runner = single_runner(tmp_path, num_partitions=3)
    try:
        for batch in batches(0, 3):
            runner.step(batch)
        scheduler = {"last_epoch": 3}
        directory = runner.save(extra=scheduler)
        assert directory.name == "step-000000003"
        for batch in batches(3, 5):
            runner.step(batch)
        assert runner.load() == scheduler and runner.global_step == 3
        for batch in batches(3, 5):
            runner.step(batch)
        assert_same(runner.state_dict(), reference(5))
    finally:
        parallax.shutdown()
    exported = tmp_path / "exported.pt"
    proc = subprocess.run([sys.executable, "-m", "parallax.cli", "export", str(tmp_path),
                           str(exported)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    model = Mixed().double()
    model.load_state_dict(torch.load(exported), strict=True)
    assert_same(model.state_dict(), reference(3))


def test_deferred_sgd_steps_are_applied_before_save_export_and_load(tmp_path: Path) -> None:
    """SGD with momentum and weight decay defers the steps of untouched rows on the servers:
    the checkpoint, the exported file, the optimizer state dict and a load over rows that
    still owe steps all see the single-device program's values."""
    runner = single_runner(tmp_path, "momentum", num_partitions=3)
    try:
        for batch in batches(0, 3):
            runner.step(batch)
        assert any(rows.pending for rows in runner.shard_optimizer._deferred.values())
        runner.save()
        runner.export(tmp_path / "at-3.pt")
        for batch in batches(3, 5):
            runner.step(batch)
        state = runner.optimizer_state_dict(runner.optimizers[0])["state"]
        want = reference_program(5, "momentum")[1].state_dict()["state"]
        assert state.keys() == want.keys()
        for key, value in want.items():
            assert_same(state[key], value)  # the momentum buffers, untouched rows caught up
        runner.step(batches(5, 6)[0])
        assert any(rows.pending for rows in runner.shard_optimizer._deferred.values())
        runner.load()  # over rows that owe steps taken after the save
        for batch in batches(3, 6):
            runner.step(batch)
        assert_same(runner.state_dict(), reference(6, "momentum"))
    finally:
        parallax.shutdown()
    assert_same(torch.load(tmp_path / "at-3.pt"), reference(3, "momentum"))
    exported = tmp_path / "exported.pt"
    proc = subprocess.run([sys.executable, "-m", "parallax.cli", "export", str(tmp_path),
                           str(exported)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert_same(torch.load(exported), reference(3, "momentum"))


def test_checkpoint_of_another_model_is_refused_naming_the_parameters(tmp_path: Path) -> None:
    runner = single_runner(tmp_path)
    try:
        runner.step(batches(0, 1)[0])
        runner.save()
    finally:
        parallax.shutdown()
    torch.manual_seed(0)
    other = nn.Sequential(nn.Embedding(40, 6))
    runner = parallax.get_runner(other, torch.optim.SGD(other.parameters(), lr=0.1),
                                 lambda out, y: out.sum(), config=parallax.Config(resume=False))
    try:
        with pytest.raises(CheckpointError, match=r"does not belong to this model: "
                           r"'bag.weight' is not in the model.*'0.weight' is not in the "
                           r"checkpoint"):
            runner.load(tmp_path)
    finally:
        parallax.shutdown()


def test_corrupted_checkpoint_is_detected_and_a_failed_save_keeps_the_previous(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = single_runner(tmp_path)
    try:
        runner.step(batches(0, 1)[0])
        good = runner.save()
        runner.step(batches(1, 2)[0])
        calls = []

        def crash_on_second_file(path, obj):
            calls.append(path)
            if len(calls) == 2:
                raise OSError("disk full")
            return checkpoint_files.save_object(path, obj)

        monkeypatch.setattr("parallax.checkpoint.sharded.save_object", crash_on_second_file)
        with pytest.raises(CheckpointError, match=r"rank 0: OSError: disk full.*previous "
                           r"checkpoint is intact"):
            runner.save()
        monkeypatch.undo()
        assert checkpoint_files.newest_complete(tmp_path) == good
        assert not (tmp_path / "step-000000002" / "manifest.json").exists()
        checkpoint_files.verify(good)
        runner.load()  # the previous checkpoint still loads
        assert runner.global_step == 1
        shard = good / "tables" / "embedding.weight" / "server-0.pt"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
        runner.step(batches(1, 2)[0])
        before = runner.state_dict()
        with pytest.raises(CheckpointError, match=r"server-0.pt.*checksum mismatch.*nothing "
                           r"was loaded"):
            runner.load()
        assert runner.global_step == 2
        assert all(torch.equal(value, runner.state_dict()[k]) for k, value in before.items())
    finally:
        parallax.shutdown()


@pytest.mark.parametrize("mode", ["raise", "skip"])
def test_nonfinite_loss_raises_or_skips_on_every_worker_alike(tmp_path: Path, mode: str) -> None:
    model, optimizer = checkpoint_worker.build()

    def loss_with_nan(output, target):
        loss = loss_fn(output, target)
        return loss * float("nan") if poisoned else loss

    runner = parallax.get_runner(model, optimizer, loss_with_nan,
                                 config=parallax.Config(nonfinite=mode))
    try:
        poisoned = False
        runner.step(batches(0, 1)[0])
        before = {k: v.clone() for k, v in runner.state_dict().items()}
        poisoned = True
        if mode == "raise":
            with pytest.raises(FloatingPointError, match=r"rank 0, step 2: NaN or infinite loss "
                               r"on rank\(s\) \[0\].*aggregated gradient of \[.*embedding.weight"):
                runner.step(batches(1, 2)[0])
        else:
            runner.step(batches(1, 2)[0])
            assert runner.skipped_steps == 1
        assert_same(runner.state_dict(), before)  # nothing was updated
    finally:
        parallax.shutdown()


def test_checkpoint_config_is_checked() -> None:
    with pytest.raises(parallax.ConfigError, match="Config.checkpoint_every_steps must be None "
                       "unless Config.checkpoint_dir says where checkpoints go, got 5"):
        parallax.Config(checkpoint_every_steps=5)
    with pytest.raises(parallax.ConfigError, match="Config.nonfinite must be one of"):
        parallax.Config(nonfinite="warn")
    with pytest.raises(parallax.ConfigError, match="Config.checkpoint_keep must be an int >= 1"):
        parallax.Config(checkpoint_dir="x", checkpoint_keep=0)
    assert json.dumps(parallax.Config(checkpoint_dir=Path("ckpt")).to_dict())
