"""Training to a validation target, for benchmarks/time_to_quality.py (run inside
compare_worker.py's process group): every system trains the same program on the same batches
from step 1, a full-softmax validation loss is taken every ``eval_every`` steps (its time not
counted), and training stops at the first evaluation at or below the target.

Every system here is synchronous and exact (the same parameters as one device after every
step, up to float rounding), so each needs the same number of steps to the target: the time
to quality differs by the step times alone. Every step counts from the first, the warm-up in
which the hybrid measures α and places its tables included; building the system does not.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from workloads import Workload

import parallax
from parallax.cluster import current_worker
from parallax.step.forward import mean_loss, to_device


def evaluate(system: str, step: Callable[[Any], Any], runner: parallax.Runner | None,
             workload: Workload, batches: Sequence[Any]) -> float:
    """Mean validation loss over every rank's ``batches`` (all ranks pass as many, of one
    size), of the model as ``system`` holds it now."""
    if runner is not None:
        return runner.evaluate(batches)
    model = step.model  # type: ignore[attr-defined]
    device = current_worker().device
    if system.startswith("torchrec"):
        to_input = step.to_input  # type: ignore[attr-defined]

        def forward(inputs: Any) -> Tensor:
            return model(to_input(to_device(inputs, device)))
    else:
        def forward(inputs: Any) -> Tensor:
            return model(*to_device(inputs, device))
    return mean_loss(forward, workload.loss, batches, group=dist.group.WORLD, device=device)


def train_to_target(system: str, step: Callable[[Any], Any], runner: parallax.Runner | None,
                    workload: Workload, generator: torch.Generator, quality: dict,
                    ) -> dict[str, Any]:
    """Train until the validation loss is at or below ``quality["target"]`` or
    ``quality["max_steps"]`` steps have run; the curve of (step, training seconds, validation
    loss), evaluated at step 0 and every ``quality["eval_every"]`` steps. Training seconds:
    each rank's time inside ``step``, averaged over ranks at each evaluation."""
    worker = current_worker()
    cuda = worker.device.type == "cuda"
    batches = workload.validation(worker.rank, worker.world_size, quality["windows"])
    target, every, limit = quality["target"], quality["eval_every"], quality["max_steps"]
    curve = [{"step": 0, "seconds": 0.0,
              "validation_loss": evaluate(system, step, runner, workload, batches)}]
    seconds, losses, reached = 0.0, [], None
    for n in range(1, limit + 1):
        batch = workload.batch(generator)
        start = time.perf_counter()
        loss = step(batch)
        if cuda:  # kernels run after the call returns: the step ends when they have
            torch.cuda.synchronize(worker.device)
        seconds += time.perf_counter() - start
        losses.append(float(loss))
        if n % every and n != limit:
            continue
        mean_seconds = _mean_over_ranks(seconds)
        validation = evaluate(system, step, runner, workload, batches)
        curve.append({"step": n, "seconds": mean_seconds, "validation_loss": validation,
                      "training_loss": _mean_over_ranks(sum(losses[-every:])
                                                        / len(losses[-every:]))})
        if not math.isfinite(validation):
            break
        if validation <= target:
            reached = curve[-1]
            break
    return {"system": system, "target": target, "eval_every": every, "max_steps": limit,
            "validation_windows": quality["windows"], "curve": curve,
            "reached": reached is not None,
            "steps_to_target": reached["step"] if reached else None,
            "seconds_to_target": reached["seconds"] if reached else None,
            "step_s": curve[-1]["seconds"] / curve[-1]["step"] if curve[-1]["step"] else None,
            "world_size": worker.world_size, "machines": len(worker.server_ranks)}


def _mean_over_ranks(value: float) -> float:
    total: Tensor = torch.tensor(value, dtype=torch.float64)
    dist.all_reduce(total)
    return float(total) / dist.get_world_size()
