"""The "Extending" contracts (docs/extending.md): a registered architecture or dense-sync
hook is what a run uses (each registry is the one place its name is looked up), and the
page's hook example runs as printed."""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.distributed as dist
from models import EmbeddingRegressor
from torch import nn

import parallax
from parallax.config import ArchitectureName, DenseSyncName
from parallax.engine import dense_sync
from parallax.engine.dense_sync import DenseSyncState
from parallax.planning import architectures

README = Path(__file__).resolve().parents[2] / "docs" / "extending.md"


def _train(config: parallax.Config, steps: int = 3) -> parallax.Runner:
    torch.manual_seed(0)
    model = EmbeddingRegressor()
    runner = parallax.get_runner(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                 nn.functional.mse_loss, config=config)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        runner.step((torch.randint(10, (4, 3), generator=generator), torch.rand(4)))
    return runner


def _syncs(runner: parallax.Runner) -> dict[str, str]:
    return {p.name: p.sync for p in runner.plan.parameters}


def test_the_registered_architecture_decides(single_process, monkeypatch) -> None:
    """alpha_threshold 0 moves the table to AllReduce; a hybrid subclass registered in its
    place that never moves keeps it on the servers."""
    config = parallax.Config(alpha_threshold=0.0, sparsity_warmup_steps=1, partition_cache=None)
    # replicated; on one worker its rows stay gathered (updated where touched)
    assert _syncs(_train(config))["embedding.weight"] == "allgatherv"
    parallax.shutdown()

    class FixedHybrid(architectures.Hybrid):
        def moves_to_allreduce(self, table, measured, *, config, worker):
            return False, ""

    monkeypatch.setitem(architectures.ARCHITECTURES, ArchitectureName.HYBRID, FixedHybrid())
    assert _syncs(_train(config))["embedding.weight"] == "ps"


def _readme_hook() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    (block,) = [b for b in blocks if "def fp16_allreduce" in b]
    return "\n".join(line for line in block.splitlines() if not line.startswith("HOOKS["))


def test_the_readme_dense_sync_example_runs_in_the_registry(single_process,
                                                            monkeypatch) -> None:
    """The README's fp16 hook, registered under a name, is the hook DDP calls: its byte count
    (2 bytes per element) is what the run records, and training still moves the weights."""
    namespace = {"DenseSyncState": DenseSyncState, "dist": dist, "torch": torch}
    exec(compile(_readme_hook(), str(README), "exec"), namespace)  # noqa: S102
    calls = []

    def counted(state, bucket):
        calls.append(bucket.buffer().numel())
        return namespace["fp16_allreduce"](state, bucket)

    counted.__annotations__ = {"state": DenseSyncState, "bucket": dist.GradBucket}
    monkeypatch.setitem(dense_sync.HOOKS, DenseSyncName.FLAT, counted)
    config = parallax.Config(dense_sync="flat", sparsity_warmup_steps=0, partition_cache=None)
    torch.manual_seed(0)
    before = EmbeddingRegressor()
    runner = _train(config)
    assert calls and calls[0] == sum(p.numel() for p in runner.module.parameters()
                                     if p.requires_grad)
    assert not torch.equal(runner.model.head.weight, before.head.weight)


def _readme_class(marker: str, namespace: dict) -> dict:
    """The README's example class holding ``marker``, run without its registry line."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    (block,) = [b for b in blocks if marker in b]
    code = "\n".join(line for line in block.splitlines() if "_SYNCS[" not in line
                     and "SYNC_MODES[" not in line)
    exec(compile(code, str(README), "exec"), namespace)  # noqa: S102
    return namespace


def test_the_readme_sync_mode_drives_every_step(single_process, monkeypatch) -> None:
    """The README's TimedSync, registered under "sync", is the mode the runner builds: its
    push runs once per step, and training is still the synchronous one (the weights move)."""
    import time

    from parallax.config import SyncName
    from parallax.step import sync_modes
    namespace = _readme_class("class TimedSync", {"Synchronous": sync_modes.Synchronous,
                                                  "time": time})
    monkeypatch.setitem(sync_modes.SYNC_MODES, SyncName.SYNC, namespace["TimedSync"])
    torch.manual_seed(0)
    before = EmbeddingRegressor()
    runner = _train(parallax.Config(sparsity_warmup_steps=0, partition_cache=None), steps=3)
    assert isinstance(runner.sync_mode, namespace["TimedSync"])
    assert len(runner.sync_mode.push_seconds) == 3
    assert not torch.equal(runner.state_dict()["embedding.weight"], before.embedding.weight)


def test_the_readme_dense_sync_kind_runs_at_the_end_of_steps(single_process,
                                                             monkeypatch) -> None:
    """The README's LocalSGD, registered under "flat", is the kind the runner builds: no DDP
    wraps the module, and its end_step runs after every step (averaging every fourth)."""
    from parallax.engine.dense_sync import strategy
    namespace = _readme_class("class LocalSGD", {"DenseSync": strategy.DenseSync, "dist": dist,
                                                 "torch": torch})
    rounds = []

    class Counted(namespace["LocalSGD"]):
        def end_step(self, step):
            rounds.append(step)
            super().end_step(step)

    monkeypatch.setitem(strategy.DENSE_SYNCS, DenseSyncName.FLAT, Counted)
    runner = _train(parallax.Config(dense_sync="flat", sparsity_warmup_steps=0,
                                    partition_cache=None), steps=5)
    assert isinstance(runner.dense, Counted) and runner.module is runner.dense.executed
    assert rounds == [1, 2, 3, 4, 5]
