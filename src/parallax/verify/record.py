"""Inside a run started by ``parallax verify``: record the model's state after every step.

``parallax verify`` runs the user's program twice with `VERIFY_ENV` set: once as the
*reference* (one process, the global batch) and once *distributed*. Each run writes the
model's plain single-device state (every parameter and buffer) before the first step
(``step_00000.pt``) and after each of the first ``steps`` steps, then ends with
`VerifyComplete`; the command compares the two folders (`parallax.verify.compare`).
A step is a round in which every optimizer stepped once, as `Runner` counts them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["RUN_FILE", "VERIFY_ENV", "StateRecorder", "Verification",
           "active", "add_hint", "describe_run", "extra_models", "model_folder", "step_file"]

VERIFY_ENV = "PARALLAX_VERIFY"
RUN_FILE = "run.json"  # what the run was ("kind") and what may make it differ ("hints")


@dataclass(frozen=True)
class Verification:
    """What ``parallax verify`` asked of this run (`VERIFY_ENV`, JSON)."""

    directory: str  # where this run writes its states
    # "reference" (the port on one process, the global batch), "original" (the program before
    # the port, `parallax.verify.original`) or "distributed"
    role: str
    steps: int  # steps to record; the run ends after the last
    workers: int  # the distributed run's workers: the reference's batch is this many times
    float64: bool = False  # the program runs with torch's default dtype float64

    def to_env(self) -> str:
        return json.dumps(asdict(self))


def active() -> Verification | None:
    """This run's `Verification`, or None outside ``parallax verify``."""
    text = os.environ.get(VERIFY_ENV)
    return Verification(**json.loads(text)) if text else None


_recording: dict[str, int] = {}  # per verification folder, the models recorded into it


def step_file(directory: str | os.PathLike[str], step: int) -> Path:
    """Where the state after ``step`` (0: before the first) is written."""
    return Path(directory) / f"step_{step:05d}.pt"


class StateRecorder:
    """Writes states ``0..steps`` (when ``writes``: the distributed run's rank 0) and says
    when the last is written. A program's first model (its first `parallax.distribute` or
    `parallax.get_runner`) records into the verification's folder and ends the run after its
    last step; a second and later one (a GAN's other network, a teacher) into
    `model_folder` ``model2``, ... inside it, each step of its own, until the run ends."""

    def __init__(self, verification: Verification, *, writes: bool) -> None:
        index = _recording.get(verification.directory, 0)
        _recording[verification.directory] = index + 1
        self.verification = verification
        self.writes = writes
        self.step = 0
        #: whether this is the program's first model (whose last step ends the run)
        self.first = index == 0
        self.directory = (verification.directory if self.first
                          else str(model_folder(verification.directory, index + 1)))
        if writes:
            Path(self.directory).mkdir(parents=True, exist_ok=True)

    def record(self, state: Mapping[str, Tensor]) -> None:
        if self.writes:
            plain = {name: value.detach().to("cpu", copy=True) for name, value in state.items()}
            path = step_file(self.directory, self.step)
            torch.save(plain, path.with_suffix(".tmp"))
            os.replace(path.with_suffix(".tmp"), path)  # a reader never sees half a file
        self.step += 1

    @property
    def done(self) -> bool:
        """Whether this is the first model and the state after the last asked-for step is
        written (the run ends then)."""
        return self.first and self.step > self.verification.steps


def model_folder(directory: str | os.PathLike[str], number: int) -> Path:
    """Where the program's ``number``-th model (2, 3, ...) records inside a run's folder."""
    return Path(directory) / f"model{number}"


def extra_models(directory: str | os.PathLike[str]) -> list[int]:
    """The numbers (2, 3, ...) of the further models a run recorded, in order."""
    found = [int(p.name.removeprefix("model")) for p in Path(directory).glob("model*")
             if p.is_dir() and p.name.removeprefix("model").isdigit()]
    return sorted(found)


def describe_run(verification: Verification, model: nn.Module, kind: str) -> None:
    """Write `RUN_FILE`: the run's kind and what in ``model`` trains differently on several
    workers (for the report's hints)."""
    hints = []
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0 and module.training:
            hints.append(f"{name or 'the model'} is {type(module).__name__}(p={module.p}): each "
                         f"worker draws its own masks for its rows, as under DDP, so training "
                         f"differs from one device's; verify with p=0 (or in eval mode)")
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training:
            hints.append(f"{name or 'the model'} is {type(module).__name__}: its statistics are "
                         f"per worker's batch, as under DDP, not the global batch's")
    low = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()
                  if p.dtype in (torch.bfloat16, torch.float16)})
    if low:
        hints.append(f"parameters in {' and '.join(low)}: each worker's gradient is rounded to "
                     f"{low[0]} before the sum over workers, as under DDP, so the runs agree "
                     f"only to that precision; compare with --tolerance at its scale (e.g. "
                     f"1e-2), or verify the program in float32/float64")
    _update_run(verification.directory, kind=kind, hints=hints)


def add_hint(text: str) -> None:
    """Note ``text`` for the report, from the reference run (no-op elsewhere)."""
    verification = active()
    if verification is not None and verification.role in ("reference", "original"):
        _update_run(verification.directory, hints=[text])


def _update_run(directory: str, *, kind: str | None = None, hints: list[str]) -> None:
    """Set `RUN_FILE`'s kind (when given) and add the hints it does not hold yet."""
    path = Path(directory) / RUN_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    run: dict[str, Any] = (json.loads(path.read_text()) if path.exists()
                           else {"kind": "", "hints": []})
    if kind is not None:
        run["kind"] = kind
    run["hints"] += [hint for hint in hints if hint not in run["hints"]]
    path.write_text(json.dumps(run))
