"""In and out of ``torch.distributed.checkpoint`` (DCP), the ecosystem's checkpoint format.

Out: `export_dcp` writes a parallax checkpoint's model as a DCP checkpoint of the
single-device ``state_dict`` (DCP's own ``FileSystemWriter``), which DCP's tools read:
``torch.distributed.checkpoint.load`` into a single-device model's state dict, or
``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` into one file that plain
``torch.load`` reads. The tables go through parallax's streamed export first (a table larger
than this machine's memory is read back memory-mapped, never whole), then DCP writes them.

In: `load_dcp` reads a DCP checkpoint of the same model (written by DCP from a single-device
or DDP program, or by `export_dcp`) into a plain state dict, which a running job takes through
its single-device view: ``model.load_state_dict(parallax.checkpoint.load_dcp(path))`` under
`parallax.distribute`, or ``runner.load_state_dict(...)``; each server keeps its rows.

What stays our own format, and why (`parallax.checkpoint`): a server's shard is the rows
``id % P == p`` of a table (strided, with ``P`` searched during training), which DCP's
contiguous chunks cannot describe, and our checkpoints checksum and fsync every file, which
DCP does not. So training checkpoints (``Config.checkpoint_dir``) stay parallax's, and DCP is
the exchange format at their edges. The optimizer's state goes through DCP's own calls
(``get_state_dict``/``set_state_dict`` on the distributed model and optimizer, which answer
them as the single-device program's: docs/checkpoints.md).

``save_dcp`` writes a running job's model through DCP itself (collective): model
parallelism's split weights as their DTensor shards, each written by its rank (DCP's sharded
entries, which DCP re-shards on load into any layout, and `load_dcp` reads whole), the rest of
the single-device ``state_dict`` once.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from parallax.checkpoint.export import stream_export
from parallax.checkpoint.files import CheckpointError
from parallax.errors import ArgumentTypeError

# torch.distributed.checkpoint is imported where it is used: importing it imports DTensor,
# 0.6 s of every process's start (parallax imports this module through parallax.checkpoint)

__all__ = ["export_dcp", "load_dcp", "save_dcp"]


class _Job(Protocol):
    def sharded_state_dict(self) -> dict[str, torch.Tensor]: ...


def export_dcp(checkpoint: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Write ``checkpoint``'s model (a step folder, or the root: its newest complete step) as
    a DCP checkpoint in folder ``out`` (one process, no process group needed)."""
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".parallax-dcp-", dir=out) as tmp:
        plain = Path(tmp) / "model.pt"
        stream_export(checkpoint, plain)
        state = torch.load(plain, mmap=True, weights_only=True)
        with _one_process():
            dcp_save(state, checkpoint_id=out, no_dist=True)
    return out


def save_dcp(job: Any, out: str | os.PathLike[str]) -> Path:
    """Write the running job's model (a `Runner`, or the model `parallax.distribute`
    returned) as a DCP checkpoint in folder ``out``. Collective: every rank calls it; each
    writes its own shards of model parallelism's split weights, and DCP writes the rest (the
    single-device values, the same on every rank) once. `load_dcp` reads it back whole, and
    ``dcp.load`` into DTensors of another layout re-shards it."""
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    runner: _Job = getattr(job, "runner", job)
    if not hasattr(runner, "sharded_state_dict"):
        raise ArgumentTypeError(f"save_dcp takes a parallax Runner or the model "
                                f"parallax.distribute returned, not {type(job).__name__}")
    state = runner.sharded_state_dict()
    out = Path(out)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dcp_save(state, checkpoint_id=out)
    else:
        with _one_process():
            dcp_save(state, checkpoint_id=out, no_dist=True)
    return out


def load_dcp(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """A DCP checkpoint's tensors as a plain state dict (every tensor whole, on the CPU)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    path = Path(path)
    reader = FileSystemReader(path)
    try:
        metadata = reader.read_metadata()
    except (FileNotFoundError, OSError) as error:
        raise CheckpointError(f"{path}: not a DCP checkpoint (no readable .metadata: "
                              f"{error})") from error
    state: dict[str, torch.Tensor] = {}
    for key, item in metadata.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            raise CheckpointError(f"{path}: entry {key!r} is not a tensor (a DCP checkpoint of "
                                  f"a model's state_dict holds tensors only)")
        state[key] = torch.empty(item.size, dtype=item.properties.dtype)
    with _one_process():
        dcp_load(state, checkpoint_id=path, no_dist=True)
    return state


@contextmanager
def _one_process() -> Iterator[None]:
    """DCP warns that it assumes one process: here that is the intent, not a guess."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        yield
