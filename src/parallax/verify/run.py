"""A `Runner` under ``parallax verify`` (the distributed run, and a `get_runner` program's
one-worker reference): its plain state recorded after construction and after each step."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist

from parallax.errors import UnsupportedProgramError, VerifyComplete
from parallax.loader import reachable_loaders
from parallax.session import shutdown
from parallax.verify.record import StateRecorder, Verification, add_hint, describe_run

if TYPE_CHECKING:
    from parallax.runner import Runner

__all__ = ["RunRecorder", "note_unsharded"]


class RunRecorder:
    """Records ``runner``'s plain state now and after each step (collective: every rank
    gathers, rank 0 writes); after the last, every rank leaves the program with
    `VerifyComplete`."""

    def __init__(self, verification: Verification, runner: Runner) -> None:
        if not runner.sync_mode.aligned:
            raise UnsupportedProgramError(
                f"parallax verify: Config.sync={runner.config.sync!r} trains asynchronously, "
                f"which differs from one device by design (stale reads); verify the "
                f"program with the default sync='sync'")
        self.runner = runner
        self.recorder = StateRecorder(verification, writes=runner.worker.rank == 0)
        if verification.role == "reference":
            describe_run(verification, runner.model,
                         "the program's one-worker run (parallax.get_runner in one process)")
        self.recorder.record(runner.state_dict())

    def after_step(self, done: object = None) -> None:
        """A step hook (`parallax.step.hooks`)."""
        self.recorder.record(self.runner.state_dict())
        note_unsharded(self.recorder)
        if self.recorder.done:
            dist.barrier(group=self.runner.group)  # rank 0 has written
            shutdown()
            raise VerifyComplete(self.recorder.verification.steps)


def note_unsharded(recorder: StateRecorder) -> None:
    """After the reference's first step: a program whose data never went through
    `parallax.shard` gets a hint (its reference cannot read the global batch)."""
    if recorder.step == 2 and not reachable_loaders():
        add_hint("the program's data does not go through parallax.shard, so the one-process "
                 "reference run read the loader's own batch, not the distributed run's global "
                 "batch: wrap the DataLoader in parallax.shard (it keeps a DistributedSampler's "
                 "order) to verify")
