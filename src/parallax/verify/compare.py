"""Compare the states two ``parallax verify`` runs recorded, step by step, tensor by tensor.

For every parameter and buffer: the largest absolute difference over the steps both runs
recorded, the step where it was largest, and the first step where it went above the
tolerance. Step 0 is the state before training (a difference there is the initialisation's).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from parallax.verify.record import RUN_FILE, step_file

__all__ = ["Comparison", "TensorDifference", "compare_runs", "recorded_steps"]


@dataclass
class TensorDifference:
    """One tensor's largest difference between the runs."""

    name: str
    max_difference: float = 0.0
    at_step: int = 0
    first_step_above: int | None = None  # None: never above the tolerance


@dataclass
class Comparison:
    """The whole comparison: what `parallax verify` prints and writes as JSON."""

    tolerance: float
    reference_steps: int  # steps each run recorded after the initial state
    distributed_steps: int
    tensors: list[TensorDifference] = field(default_factory=list)
    only_in_reference: list[str] = field(default_factory=list)
    only_in_distributed: list[str] = field(default_factory=list)
    shape_mismatches: list[str] = field(default_factory=list)
    hints: list[str] = field(default_factory=list)
    reference_kind: str = ""  # plain PyTorch, or the program's one-worker run
    #: the floating dtypes the recorded states really had ("float64", "float32", ...)
    dtypes: list[str] = field(default_factory=list)

    @property
    def steps(self) -> int:
        """Steps compared (both runs recorded them)."""
        return min(self.reference_steps, self.distributed_steps)

    @property
    def above(self) -> list[TensorDifference]:
        """Tensors that went above the tolerance, the earliest first."""
        return sorted((t for t in self.tensors if t.first_step_above is not None),
                      key=lambda t: (t.first_step_above, -t.max_difference))

    @property
    def equal(self) -> bool:
        return (self.steps > 0 and not self.above and not self.only_in_reference
                and not self.only_in_distributed and not self.shape_mismatches
                and self.reference_steps == self.distributed_steps)

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "steps": self.steps, "equal": self.equal},
                          indent=2)


def recorded_steps(directory: str | os.PathLike[str]) -> int:
    """Steps recorded in ``directory`` after the initial state (-1: not even that)."""
    step = 0
    while step_file(directory, step).exists():
        step += 1
    return step - 1


def compare_runs(reference: str | os.PathLike[str], distributed: str | os.PathLike[str],
                 tolerance: float) -> Comparison:
    """Compare the runs recorded in the two folders (every step both recorded)."""
    result = Comparison(tolerance, recorded_steps(reference), recorded_steps(distributed))
    run = Path(reference) / RUN_FILE
    if run.exists():
        described = json.loads(run.read_text())
        result.hints, result.reference_kind = described["hints"], described["kind"]
    tensors: dict[str, TensorDifference] = {}
    for step in range(result.steps + 1):
        ours = torch.load(step_file(reference, step), weights_only=True)
        theirs = torch.load(step_file(distributed, step), weights_only=True)
        if step == 0:
            result.only_in_reference = sorted(set(ours) - set(theirs))
            result.only_in_distributed = sorted(set(theirs) - set(ours))
            result.shape_mismatches = [
                f"{n}: {tuple(ours[n].shape)} vs {tuple(theirs[n].shape)}"
                for n in ours if n in theirs and ours[n].shape != theirs[n].shape]
            tensors = {n: TensorDifference(n) for n in ours
                       if n in theirs and ours[n].shape == theirs[n].shape}
            result.dtypes = sorted({str(t.dtype).removeprefix("torch.")
                                    for t in (*ours.values(), *theirs.values())
                                    if t.is_floating_point()})
        for name, entry in tensors.items():
            difference = _max_difference(ours[name], theirs[name])
            if difference > entry.max_difference or step == 0:
                entry.max_difference, entry.at_step = difference, step
            if difference > tolerance and entry.first_step_above is None:
                entry.first_step_above = step
    result.tensors = list(tensors.values())
    return result


def _max_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    both_nan = torch.isnan(a64) & torch.isnan(b64)
    same = (a64 == b64) | both_nan  # equal infinities too
    difference = torch.where(same, 0.0, (a64 - b64).abs())
    return float(difference.nan_to_num(nan=float("inf")).max())
