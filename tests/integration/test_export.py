"""Exporting a sharded checkpoint to one plain state_dict (``parallax export``).

The checkpoints are written by hand with the file layer, laid out as the runner lays them
out: the dense state in ``dense.pt``, every table in row shards with interleaved ids.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from parallax.checkpoint.export import export, export_state_dict, read_checkpoint
from parallax.checkpoint.files import (
    CheckpointError,
    Manifest,
    save_object,
    step_dir,
    write_manifest,
)
from parallax.cli import main

REPO = Path(__file__).resolve().parents[2]
#: Tables of the tiny model and how many files (partitions) each is split into.
TABLES = {"embed.weight": 3, "pos": 2, "row_bias": 2}
ALIASES = {"decoder.weight": "embed.weight"}


class Tiny(nn.Module):
    """An embedding tied to its decoder, a dense layer, a buffer, a 3-D and a 1-D table."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 3)
        self.hidden = nn.Linear(3, 4)
        self.decoder = nn.Linear(3, 10, bias=False)
        self.decoder.weight = self.embed.weight
        self.pos = nn.Parameter(torch.randn(6, 2, 2))
        self.row_bias = nn.Parameter(torch.randn(7))
        self.register_buffer("scale", torch.tensor(2.0))


def make_model(seed: int) -> Tiny:
    torch.manual_seed(seed)
    return Tiny()


def write_checkpoint(root: Path, step: int, model: nn.Module, *, drop: int | None = None,
                     repeat: int | None = None) -> Path:
    """What the runner writes; ``drop``/``repeat`` leave out / duplicate that row of the
    embedding table."""
    directory = step_dir(root, step)
    params = dict(model.named_parameters())
    state = model.state_dict()
    files = {}
    dense = {k: v for k, v in state.items() if k not in TABLES and k not in ALIASES}
    files["dense.pt"] = save_object(directory / "dense.pt", {"model": dense, "optimizers": []})
    tables = {}
    for name, parts in TABLES.items():
        value = params[name].detach()
        num_rows, row_shape = value.shape[0], list(value.shape[1:])
        relpaths = []
        for part in range(parts):
            ids = torch.arange(num_rows)[torch.arange(num_rows) % parts == part]
            if name == "embed.weight" and drop is not None:
                ids = ids[ids != drop]
            if name == "embed.weight" and repeat is not None and part == 0:
                ids = torch.cat([ids, torch.tensor([repeat])])
            rows = value[ids].clone()
            relpath = f"tables/{name}/part-{part}.pt"
            files[relpath] = save_object(directory / relpath, {
                "ids": ids, "values": rows, "state": {"exp_avg": torch.zeros_like(rows)},
                "scalars": {"step": step},
            })
            relpaths.append(relpath)
        tables[name] = {"files": relpaths, "num_rows": num_rows, "row_shape": row_shape,
                        "dtype": "float32", "sync": "ps", "partitions": parts}
    meta = {
        "format": "parallax-checkpoint",
        "step": step,
        "parameters": {n: {"shape": list(p.shape), "dtype": "float32"}
                       for n, p in params.items()},
        "aliases": ALIASES,
        "tables": tables,
        "dense_file": "dense.pt",
    }
    write_manifest(directory, Manifest(step=step, files=files, meta=meta))
    return directory


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def assert_same_state(actual: dict[str, torch.Tensor], model: nn.Module) -> None:
    expected = model.state_dict()
    assert sorted(actual) == sorted(expected)
    for key, value in expected.items():
        assert actual[key].shape == value.shape, key
        assert torch.equal(actual[key], value), key


def test_export_rebuilds_the_state_dict_and_loads_strictly(tmp_path):
    model = make_model(0)
    directory = write_checkpoint(tmp_path / "ckpt", 7, model)
    out = export(directory, tmp_path / "model.pt")
    assert out == tmp_path / "model.pt"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "model.pt"]  # no temp left
    loaded = torch.load(out, weights_only=True)
    assert_same_state(loaded, model)
    assert loaded["decoder.weight"].data_ptr() == loaded["embed.weight"].data_ptr()
    fresh = make_model(1)
    assert not torch.equal(fresh.embed.weight, model.embed.weight)
    fresh.load_state_dict(loaded, strict=True)
    assert_same_state(fresh.state_dict(), model)
    assert fresh.decoder.weight is fresh.embed.weight


def test_root_exports_the_newest_complete_step(tmp_path):
    root = tmp_path / "ckpt"
    write_checkpoint(root, 5, make_model(0))
    newest = make_model(2)
    write_checkpoint(root, 12, newest)
    step_dir(root, 20).mkdir()  # a save in progress: no manifest yet
    exported = read_checkpoint(root)
    assert (exported.step, exported.directory) == (12, step_dir(root, 12))
    assert_same_state(exported.state_dict, newest)


def test_missing_rows_name_the_table(tmp_path):
    directory = write_checkpoint(tmp_path, 3, make_model(0), drop=4)
    with pytest.raises(CheckpointError, match=r"'embed\.weight'.* 1 of 10 rows missing and 0 "
                       r"repeated \(first bad row 4\)"):
        export_state_dict(directory)


def test_repeated_rows_name_the_table(tmp_path):
    directory = write_checkpoint(tmp_path, 3, make_model(0), repeat=4)
    with pytest.raises(CheckpointError, match=r"'embed\.weight'.* 0 of 10 rows missing and 1 "
                       r"repeated"):
        export_state_dict(directory)


def test_no_complete_checkpoint_under_root(tmp_path):
    step_dir(tmp_path, 1).mkdir()
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        export_state_dict(tmp_path)
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        export_state_dict(tmp_path / "nowhere")


def test_not_a_parallax_checkpoint(tmp_path):
    directory = step_dir(tmp_path, 1)
    write_manifest(directory, Manifest(step=1, meta={"servers": 2}))
    with pytest.raises(CheckpointError, match=r"meta\.format is None"):
        export_state_dict(directory)


def test_cli_missing_rows_is_a_usage_error(tmp_path, capsys):
    write_checkpoint(tmp_path / "ckpt", 3, make_model(0), drop=0)
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out.pt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("parallax: error: ") and "'embed.weight'" in err
    assert not (tmp_path / "out.pt").exists()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "parallax.cli", "export", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def test_cli_exports_and_reports_corrupt_files(tmp_path):
    model = make_model(0)
    root = tmp_path / "ckpt"
    directory = write_checkpoint(root, 9, model)
    out = tmp_path / "model.pt"
    proc = _cli(str(root), str(out))
    tensors = len(model.state_dict())
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"parallax: exported step 9 ({tensors} tensors) to {out}"
    assert_same_state(torch.load(out, weights_only=True), model)

    shard = directory / "tables/pos/part-1.pt"
    flip_byte(shard)
    proc = _cli(str(directory), str(tmp_path / "other.pt"))
    assert proc.returncode == 2
    assert str(shard) in proc.stderr and "checksum" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "other.pt").exists()


def test_table_shapes_cover_1d_and_3d_parameters():
    """The fixture itself: its tables must include a 1-D and a 3-D parameter."""
    shapes = {n: p.shape for n, p in make_model(0).named_parameters() if n in TABLES}
    assert {len(s) for s in shapes.values()} == {1, 2, 3}
    assert all(math.prod(s) > 0 for s in shapes.values())


def test_a_table_larger_than_the_process_limit_exports_streamed(tmp_path):
    """``parallax export`` under RLIMIT_DATA of 400 MiB: a 600 MiB table in 15 shard files
    goes to the output file by file, never whole in the process; the file loads (mmap) to
    the very values."""
    rows, dim, parts = 600 * 2**20 // (64 * 4), 64, 15
    torch.manual_seed(0)
    values = torch.randn(rows, dim)
    directory = step_dir(tmp_path / "ckpt", 3)
    files = {"dense.pt": save_object(directory / "dense.pt", {
        "model": {"head.weight": torch.ones(2, dim)}, "optimizers": []})}
    relpaths = []
    for part in range(parts):
        ids = torch.arange(part, rows, parts)
        relpath = f"tables/embedding.weight/part-{part}.pt"
        files[relpath] = save_object(directory / relpath, {"ids": ids, "values": values[ids]})
        relpaths.append(relpath)
    meta = {"format": "parallax-checkpoint", "step": 3, "aliases": {}, "dense_file": "dense.pt",
            "parameters": {"embedding.weight": {"shape": [rows, dim], "dtype": "float32"},
                           "head.weight": {"shape": [2, dim], "dtype": "float32"}},
            "tables": {"embedding.weight": {"files": relpaths, "num_rows": rows,
                                            "row_shape": [dim], "dtype": "float32"}}}
    write_manifest(directory, Manifest(step=3, files=files, meta=meta))
    limit = 400 * 2**20

    def limited() -> None:
        import resource
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))

    out = tmp_path / "model.pt"
    proc = subprocess.run([sys.executable, "-m", "parallax.cli", "export", str(directory),
                           str(out)], capture_output=True, text=True, timeout=300, cwd=REPO,
                          preexec_fn=limited)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = torch.load(out, mmap=True, weights_only=True)
    assert torch.equal(loaded["embedding.weight"], values)
    assert torch.equal(loaded["head.weight"], torch.ones(2, dim))
    # the same program holding the table whole does not fit that limit
    whole = subprocess.run([sys.executable, "-c", f"import torch; torch.empty({rows * dim})"],
                           capture_output=True, text=True, timeout=300, preexec_fn=limited)
    assert whole.returncode != 0 and "allocate memory" in whole.stderr
