"""The checkpoint file layer: atomic writes, checksums, manifests, crash safety, retention."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from parallax.checkpoint.files import (
    MANIFEST_NAME,
    TMP_PREFIX,
    CheckpointError,
    FileRecord,
    Manifest,
    find_checkpoint,
    load_object,
    newest_complete,
    prune,
    read_manifest,
    save_object,
    step_dir,
    verify,
    write_atomic,
    write_manifest,
)

PYTHON = sys.executable


def save_checkpoint(root: Path, step: int, servers: int = 2) -> Path:
    """What the runner does: every server writes its shard, then rank 0 the manifest."""
    directory = step_dir(root, step)
    files = {}
    for server in range(servers):
        name = f"server-{server}/shard.pt"
        shard = {"rows": torch.full((4, 3), float(step * 10 + server)), "step": step}
        files[name] = save_object(directory / name, shard)
    write_manifest(directory, Manifest(step=step, files=files, meta={"servers": servers}))
    return directory


def flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if offset is None else offset] ^= 0xFF
    path.write_bytes(bytes(data))


def temp_files(directory: Path) -> list[Path]:
    return sorted(directory.rglob(f"{TMP_PREFIX}*"))


def test_step_dir_is_zero_padded_and_rejects_negative_steps(tmp_path):
    assert step_dir(tmp_path, 42) == tmp_path / "step-000000042"
    assert step_dir(str(tmp_path), 10**10).name == "step-10000000000"
    with pytest.raises(ValueError, match="-1"):
        step_dir(tmp_path, -1)


def test_write_atomic_returns_record_of_the_bytes_and_leaves_no_temp(tmp_path):
    path = tmp_path / "new" / "deeper" / "blob.bin"
    record = write_atomic(path, b"hello")
    assert path.read_bytes() == b"hello"
    assert record == FileRecord(
        "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824", 5
    )
    assert write_atomic(path, b"replaced").size == 8
    assert path.read_bytes() == b"replaced"
    assert temp_files(tmp_path) == []


def test_write_atomic_refuses_temp_names(tmp_path):
    with pytest.raises(CheckpointError, match=r"\.tmp-x"):
        write_atomic(tmp_path / ".tmp-x", b"")


def test_round_trip_of_tensors_dicts_and_manifest(tmp_path):
    directory = step_dir(tmp_path, 7)
    emb = torch.nn.Embedding(10, 3, sparse=True)
    opt = torch.optim.Adagrad(emb.parameters())
    emb(torch.tensor([1, 4])).sum().backward()
    opt.step()
    obj = {
        "weight": emb.weight.detach().clone(),
        "grad": emb.weight.grad.coalesce(),
        "optimizer": opt.state_dict(),
        "ids": [1, 4],
        "lr": 0.5,
        "name": "emb",
        "nested": {"half": torch.arange(4, dtype=torch.bfloat16), "pair": (1, 2)},
    }
    record = save_object(directory / "server-0" / "part-0.pt", obj)
    meta = {"config": {"seed": 3, "clip": None}, "cluster": (2, 4), "position": 1234}
    write_manifest(directory, Manifest(7, {"server-0/part-0.pt": record}, meta))

    manifest = verify(directory)
    assert manifest.step == 7 and manifest.format_version == 1
    assert manifest.files == {"server-0/part-0.pt": record}
    assert manifest.meta == {"config": {"seed": 3, "clip": None}, "cluster": [2, 4],
                             "position": 1234}
    loaded = load_object(directory / "server-0" / "part-0.pt", manifest.files["server-0/part-0.pt"])
    assert torch.equal(loaded["weight"], obj["weight"])
    assert torch.equal(loaded["grad"].to_dense(), obj["grad"].to_dense())
    assert torch.equal(loaded["nested"]["half"], obj["nested"]["half"])
    assert loaded["optimizer"]["state"][0]["sum"].equal(opt.state_dict()["state"][0]["sum"])
    assert (loaded["ids"], loaded["lr"], loaded["name"]) == ([1, 4], 0.5, "emb")
    assert loaded["nested"]["pair"] == (1, 2)
    assert newest_complete(tmp_path) == directory


def test_flipped_byte_in_a_shard_is_a_checksum_error_naming_the_file(tmp_path):
    directory = save_checkpoint(tmp_path, 1)
    shard = directory / "server-1" / "shard.pt"
    flip_byte(shard)
    manifest = read_manifest(directory)
    with pytest.raises(CheckpointError, match="checksum") as err:
        verify(directory)
    assert str(shard) in str(err.value)
    with pytest.raises(CheckpointError, match="checksum") as err:
        load_object(shard, manifest.files["server-1/shard.pt"])
    assert str(shard) in str(err.value)
    load_object(directory / "server-0" / "shard.pt", manifest.files["server-0/shard.pt"])


def test_truncated_file_is_reported_as_truncated(tmp_path):
    directory = save_checkpoint(tmp_path, 1)
    shard = directory / "server-0" / "shard.pt"
    record = read_manifest(directory).files["server-0/shard.pt"]
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=f"truncated: 100 bytes, .* {record.size}") as err:
        verify(directory)
    assert str(shard) in str(err.value)
    with pytest.raises(CheckpointError, match="truncated"):
        load_object(shard, record)


def test_file_grown_is_reported(tmp_path):
    directory = save_checkpoint(tmp_path, 1)
    shard = directory / "server-0" / "shard.pt"
    with open(shard, "ab") as f:
        f.write(b"junk")
    with pytest.raises(CheckpointError, match="too long"):
        verify(directory)


def test_missing_file_is_named(tmp_path):
    directory = save_checkpoint(tmp_path, 1)
    shard = directory / "server-1" / "shard.pt"
    record = read_manifest(directory).files["server-1/shard.pt"]
    shard.unlink()
    with pytest.raises(CheckpointError, match="missing") as err:
        verify(directory)
    assert str(shard) in str(err.value)
    with pytest.raises(CheckpointError, match="missing"):
        load_object(shard, record)


def test_corrupt_manifest_is_detected(tmp_path):
    directory = save_checkpoint(tmp_path, 1)
    path = directory / MANIFEST_NAME
    good = path.read_text()
    document = json.loads(good)

    # Still valid JSON, but a size changed: only the manifest's own checksum can tell.
    edited = {**document, "files": {**document["files"]}}
    name = "server-0/shard.pt"
    edited["files"][name] = {**edited["files"][name], "size": edited["files"][name]["size"] + 1}
    path.write_text(json.dumps(edited, indent=2))
    with pytest.raises(CheckpointError, match="checksum mismatch") as err:
        read_manifest(directory)
    assert str(path) in str(err.value)

    path.write_text(good[: len(good) // 2])
    with pytest.raises(CheckpointError, match="not valid JSON"):
        read_manifest(directory)

    path.write_text(json.dumps({**document, "format_version": 2}))
    with pytest.raises(CheckpointError, match="format_version 2 is not supported"):
        read_manifest(directory)

    path.write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="JSON object"):
        read_manifest(directory)

    path.unlink()
    with pytest.raises(CheckpointError, match="missing"):
        read_manifest(directory)


def test_every_single_byte_flip_of_the_manifest_is_detected(tmp_path):
    directory = save_checkpoint(tmp_path, 1, servers=1)
    path = directory / MANIFEST_NAME
    good = path.read_bytes()
    for offset in range(len(good)):
        path.write_bytes(good[:offset] + bytes([good[offset] ^ 0x01]) + good[offset + 1:])
        try:
            manifest = read_manifest(directory)
        except CheckpointError:
            continue
        # Only JSON-insignificant bytes (whitespace) may change without an error, and then
        # the manifest read must be the original one.
        assert manifest == read_manifest_from(good, tmp_path), offset


def read_manifest_from(text: bytes, tmp_path: Path) -> Manifest:
    other = tmp_path / "other"
    other.mkdir(exist_ok=True)
    (other / MANIFEST_NAME).write_bytes(text)
    return read_manifest(other)


def test_write_manifest_rejects_keys_that_are_not_plain_relative_paths(tmp_path):
    record = FileRecord("0" * 64, 0)
    for key in ("../escape.pt", "/abs.pt", "a//b.pt", "./a.pt", "d/.tmp-1-2-x.pt",
                MANIFEST_NAME, ""):
        with pytest.raises(CheckpointError, match="file key") as err:
            write_manifest(tmp_path, Manifest(1, {key: record}))
        assert repr(key) in str(err.value)
    with pytest.raises(CheckpointError, match=r"files\['a.pt'\].sha256"):
        write_manifest(tmp_path, Manifest(1, {"a.pt": FileRecord("XYZ", 0)}))
    with pytest.raises(CheckpointError, match="not JSON-serialisable"):
        write_manifest(tmp_path, Manifest(1, {}, {"bad": object()}))
    with pytest.raises(CheckpointError, match="not JSON-serialisable"):
        write_manifest(tmp_path, Manifest(1, {}, {"bad": float("nan")}))
    assert not (tmp_path / MANIFEST_NAME).exists()


def test_interrupted_save_without_manifest_is_skipped(tmp_path, caplog):
    older = save_checkpoint(tmp_path, 100)
    newer = step_dir(tmp_path, 200)
    save_object(newer / "server-0" / "shard.pt", {"rows": torch.zeros(2)})
    (tmp_path / "step-300-not-a-checkpoint").mkdir()
    (tmp_path / "step-0000000400").mkdir()  # not the canonical name of step 400
    with caplog.at_level(logging.WARNING, logger="parallax"):
        assert newest_complete(tmp_path) == older
    assert str(newer) in caplog.text and "missing" in caplog.text


def test_corrupt_manifest_or_wrong_step_is_skipped(tmp_path, caplog):
    older = save_checkpoint(tmp_path, 1)
    newer = save_checkpoint(tmp_path, 2)
    flip_byte(newer / MANIFEST_NAME)
    copied = step_dir(tmp_path, 3)
    newer.rename(copied)  # a manifest for step 2 inside step 3's directory
    save_checkpoint(tmp_path, 2)
    flip_byte(step_dir(tmp_path, 2) / MANIFEST_NAME)
    with caplog.at_level(logging.WARNING, logger="parallax"):
        assert newest_complete(tmp_path) == older
    assert str(copied) in caplog.text


def test_newest_complete_verifies_files_only_when_asked(tmp_path):
    older = save_checkpoint(tmp_path, 1)
    newer = save_checkpoint(tmp_path, 2)
    flip_byte(newer / "server-0" / "shard.pt")
    assert newest_complete(tmp_path) == newer
    assert newest_complete(tmp_path, verify=True) == older


def test_find_checkpoint_takes_a_step_directory_or_the_newest_under_a_root(tmp_path):
    older, newer = save_checkpoint(tmp_path, 1), save_checkpoint(tmp_path, 2)
    assert find_checkpoint(tmp_path) == newer
    assert find_checkpoint(older) == older
    interrupted = step_dir(tmp_path, 3)
    interrupted.mkdir()
    assert find_checkpoint(tmp_path) == newer
    assert find_checkpoint(interrupted) is None  # nothing under it
    assert find_checkpoint(interrupted, by_name=True) == interrupted  # read_manifest says why
    assert find_checkpoint(tmp_path / "absent") is None
    assert find_checkpoint(older / MANIFEST_NAME) is None


def test_newest_complete_of_nothing_is_none(tmp_path):
    assert newest_complete(tmp_path / "absent") is None
    assert newest_complete(tmp_path) is None
    step_dir(tmp_path, 5).mkdir()
    assert newest_complete(tmp_path) is None


def test_prune_keeps_the_newest_complete_checkpoints(tmp_path):
    dirs = {step: save_checkpoint(tmp_path, step) for step in (10, 20, 30, 40, 50)}
    interrupted_old = step_dir(tmp_path, 35)  # incomplete, older than the newest complete
    save_object(interrupted_old / "server-0" / "shard.pt", {"x": 1})
    interrupted_new = step_dir(tmp_path, 60)  # incomplete, newer: maybe a save in progress
    save_object(interrupted_new / "server-0" / "shard.pt", {"x": 1})
    leftover = dirs[50] / "server-0" / f"{TMP_PREFIX}123-abcd-shard.pt"
    leftover.write_bytes(b"half a shard")

    assert verify(dirs[50]).step == 50  # a stray temp file is not mistaken for a real file
    prune(tmp_path, keep=2)
    remaining = sorted(p.name for p in tmp_path.iterdir())
    assert remaining == [step_dir(tmp_path, s).name for s in (40, 50, 60)]
    assert not leftover.exists()
    assert newest_complete(tmp_path, verify=True) == dirs[50]
    verify(dirs[40])

    prune(tmp_path, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [dirs[50].name, interrupted_new.name]


def test_prune_never_deletes_the_newest_complete_checkpoint(tmp_path):
    only = save_checkpoint(tmp_path, 9)
    prune(tmp_path, keep=1)
    assert newest_complete(tmp_path, verify=True) == only
    with pytest.raises(ValueError, match="keep must be an int >= 1, got 0"):
        prune(tmp_path, keep=0)
    prune(tmp_path / "absent", keep=1)
    # Without any complete checkpoint nothing is deleted: there is nothing to fall back on.
    other = tmp_path / "other"
    save_object(step_dir(other, 1) / "a.pt", 1)
    prune(other, keep=1)
    assert (step_dir(other, 1) / "a.pt").exists()


def start(code: str, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([PYTHON, "-c", code, *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)


def kill_when(proc: subprocess.Popen[bytes], ready, timeout_s: float = 30.0) -> tuple[bool, str]:
    """SIGKILL ``proc`` as soon as ``ready()`` holds; (whether it was killed rather than
    exiting first, its stderr)."""
    deadline = time.monotonic() + timeout_s
    killed = False
    while proc.poll() is None:
        if ready():
            os.kill(proc.pid, signal.SIGKILL)
            killed = True
            break
        if time.monotonic() > deadline:
            proc.kill()
            break
        time.sleep(0.001)
    _, stderr = proc.communicate()
    return killed, stderr.decode(errors="replace")


LARGE_WRITE = """
import sys
from pathlib import Path
from parallax.checkpoint.files import write_atomic
write_atomic(Path(sys.argv[1]), bytes(int(sys.argv[2])))
"""


def test_kill_during_a_large_write_leaves_no_partial_file(tmp_path):
    previous = save_checkpoint(tmp_path, 1)
    target = step_dir(tmp_path, 2) / "server-0" / "shard.pt"
    size = 200 << 20
    proc = start(LARGE_WRITE, str(target), str(size))
    killed, stderr = kill_when(proc, lambda: bool(temp_files(tmp_path)))
    try:
        if killed:
            # Killed while the bytes went to the temp file: nothing under the final name.
            assert proc.returncode == -signal.SIGKILL
            assert not target.exists()
        else:  # the whole write won the race against our polling: then it must be whole
            assert proc.returncode == 0, stderr
            assert target.stat().st_size == size
        assert newest_complete(tmp_path, verify=True) == previous
        assert verify(previous).step == 1
    finally:
        for path in temp_files(tmp_path):
            path.unlink()


STALLED_MANIFEST = """
import os, sys, time
import torch
from pathlib import Path
from parallax.checkpoint import files as cf
directory = cf.step_dir(Path(sys.argv[1]), 2)
files = {f"server-{i}/shard.pt": cf.save_object(directory / f"server-{i}" / "shard.pt",
                                                {"rows": torch.ones(100, 10) * i})
         for i in range(4)}
os.fsync = lambda fd: time.sleep(60)  # the manifest's bytes are written, the rename is not
cf.write_manifest(directory, cf.Manifest(2, files))
"""


def test_kill_before_the_manifest_is_renamed_keeps_the_previous_checkpoint(tmp_path):
    previous = save_checkpoint(tmp_path, 1)
    directory = step_dir(tmp_path, 2)
    proc = start(STALLED_MANIFEST, str(tmp_path))
    killed, stderr = kill_when(proc, lambda: any(p.name.endswith(MANIFEST_NAME)
                                                 for p in temp_files(directory)))
    assert killed, stderr
    assert not (directory / MANIFEST_NAME).exists()
    assert len(list(directory.glob("server-*/shard.pt"))) == 4  # the shards made it
    assert newest_complete(tmp_path, verify=True) == previous
    # The newer incomplete directory might be a save in progress: prune leaves it alone.
    prune(tmp_path, keep=1)
    assert previous.is_dir() and directory.is_dir()
    verify(previous)


def test_a_full_disk_is_named_with_the_path_and_the_bytes(tmp_path, monkeypatch):
    """torch.save reports a short write as "unexpected pos" (no OS error): the free space
    tells, and the error says "No space left on device", the file and the bytes; no partial
    file stays behind."""
    import shutil
    from collections import namedtuple

    import parallax.checkpoint.files as files

    def short_write(obj, out):
        out.write(b"x" * 100)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 100")

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(files.torch, "save", short_write)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1000, 1000, 0))
    target = tmp_path / "shard.pt"
    with pytest.raises(CheckpointError, match=r"No space left on device for \S+shard.pt: about "
                                              r"8,000 bytes to write, 100 written when the"):
        save_object(target, {"values": torch.zeros(1000, dtype=torch.float64)})
    assert list(tmp_path.iterdir()) == []


def test_an_os_out_of_space_error_is_named_and_other_errors_pass_through(tmp_path, monkeypatch):
    import errno

    def no_space(view):
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(CheckpointError, match=r"No space left on device for \S+a.bin: about 4 "):
        files_write_with(tmp_path / "a.bin", no_space, needed=4)

    def broken(view):
        raise ValueError("not a space problem")

    with pytest.raises(ValueError, match="not a space problem"):
        files_write_with(tmp_path / "b.bin", broken, needed=4)
    assert list(tmp_path.iterdir()) == []


def files_write_with(path, raise_it, needed):
    import parallax.checkpoint.files as files

    return files._write_atomic_with(path, lambda out: raise_it(out), needed=needed)


def test_a_view_of_a_larger_storage_is_written_as_its_own_elements(tmp_path) -> None:
    """A table group's member shard views the group's store: its file holds its rows only
    (``torch.save`` of the view itself would write the whole store), and loads as them."""
    store = torch.arange(100_000, dtype=torch.float64).reshape(-1, 10)
    member = store[9_000:9_010]
    record = save_object(tmp_path / "view.pt", {"values": member, "rows": [store[:2]],
                                                "pair": (store[5:6], 1)})
    whole = save_object(tmp_path / "whole.pt", {"values": store})
    assert record.size < whole.size / 100
    loaded = load_object(tmp_path / "view.pt", record)
    assert torch.equal(loaded["values"], member) and torch.equal(loaded["rows"][0], store[:2])
    assert torch.equal(loaded["pair"][0], store[5:6]) and loaded["pair"][1] == 1
