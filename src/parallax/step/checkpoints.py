"""Checkpoints of a training run: `save` and `load` through `parallax.checkpoint.sharded` (any
cluster shape, any partition counts), the newest one resumed at start-up (`Config.resume`), and
the schedule (`Config.checkpoint_every_steps` / ``checkpoint_every_secs``) as a step hook.

The checkpoint format sees the run only through its narrow `parallax.checkpoint.sharded.Run`
view (model, optimizers, tables, servers' optimizer, where this worker stands).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from parallax.checkpoint import sharded
from parallax.checkpoint.files import newest_complete
from parallax.collective import agree
from parallax.engine.diagnostics.phases import PhaseClock
from parallax.errors import ArgumentError
from parallax.logs import log
from parallax.step.hooks import StepDone

__all__ = ["Checkpoints"]


class Checkpoints:
    """``quiet``: a consistent snapshot of the servers while inside (the sync mode's);
    ``refuse``: raises where the run's state cannot be checkpointed (the dense sync's
    ``require_aggregated``); ``after_load``: told the restored step."""

    def __init__(self, run: sharded.Run, phases: PhaseClock, *,
                 quiet: Callable[[], contextlib.AbstractContextManager[None]],
                 refuse: Callable[[str, str], None], after_load: Callable[[int], None]) -> None:
        self.run = run
        self.config = run.config
        self.phases = phases
        self.quiet = quiet
        self.refuse = refuse
        self.after_load = after_load
        self.last_save = time.monotonic()

    def save(self, path: str | os.PathLike[str] | None = None, *, extra: Any = None) -> Path:
        """See `Runner.save`."""
        root = path if path is not None else self.config.checkpoint_dir
        if root is None:
            raise ArgumentError("Runner.save needs a path, or Config(checkpoint_dir=...)")
        self.refuse("checkpoints", "not implemented (the servers' dense model and each "
                                   "worker's pending update would have to be saved); "
                                   "Runner.export writes the trained model")
        keep = self.config.checkpoint_keep if path is None else None
        with self.quiet():
            directory = sharded.save(self.run, root, keep=keep, extra=extra)
        self.last_save = time.monotonic()
        return directory

    def load(self, path: str | os.PathLike[str] | None = None) -> Any:
        """See `Runner.load`."""
        root = path if path is not None else self.config.checkpoint_dir
        if root is None:
            raise ArgumentError("Runner.load needs a path, or Config(checkpoint_dir=...)")
        with self.quiet():
            extra = sharded.load(self.run, root)
        self.after_load(self.run.global_step)
        return extra

    def resume_from_newest(self) -> None:
        """`Config.resume`: load the newest complete checkpoint under
        `Config.checkpoint_dir`, if there is one (collective)."""
        root = self.config.checkpoint_dir
        if root is None or not self.config.resume:
            return
        worker = self.run.worker
        # Rank 0 reads every file of the candidate (sizes and checksums) before choosing it:
        # a checkpoint damaged since it was written is skipped with a warning naming the file,
        # and the run resumes from the newest intact one instead of failing at every restart.
        found = (str(newest_complete(root, verify=True) or "") if worker.rank == 0 else None)
        found = agree(found, rank=worker.rank, group=self.run.group)
        if found:
            self.load(found)
            log.info("parallax: resumed from step %d (%s)", self.run.global_step, root)

    def after_step(self, done: StepDone) -> None:
        """A step hook: save when the schedule says (rank 0's clock decides the seconds)."""
        if self._due(done.step):
            with self.phases.phase("checkpoint"):
                self.save()

    def _due(self, step: int) -> bool:
        config = self.config
        if config.checkpoint_every_steps and step % config.checkpoint_every_steps == 0:
            return True
        if config.checkpoint_every_secs is None:
            return False
        due = torch.tensor(float(time.monotonic() - self.last_save
                                 >= config.checkpoint_every_secs),
                           device=self.run.worker.device)
        dist.broadcast(due, src=0, group=self.run.group)
        return bool(due)
