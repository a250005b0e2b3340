"""`get_runner`: the call that turns a single-device program into a distributed one."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

import torch

from parallax.cluster import current_worker, parse_resources
from parallax.config import Config
from parallax.engine.optimizers.shard_optimizer import (
    as_optimizer_list,
    check_in_model,
    check_lazy,
    check_per_shard,
)
from parallax.errors import ArgumentTypeError
from parallax.launch.elastic import install_error_recorder, launch
from parallax.model.detect import find_sparse_parameters, tracing_once
from parallax.model.exactness import check_exact, check_not_compiled
from parallax.planning.architectures import server_held
from parallax.runner import LossFn, Runner
from parallax.session import join, single_process_worker
from parallax.verify import record as verify
from parallax.verify.run import RunRecorder

__all__ = ["build_runner", "get_runner"]


def get_runner(model: torch.nn.Module,
               optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
               loss_fn: LossFn, *, resources: str | os.PathLike[str] | None = None,
               config: Config | None = None) -> Runner:
    """Wrap a single-device training program for hybrid data-parallel training.

    * Inside a worker (started by ``parallax run``, by ``torchrun``, or by this function),
      joins the process group and returns the `Runner`.
    * In a plain ``python train.py`` with ``resources``: launches one worker per resource slot
      running this same script, waits for them, and exits with their status (as the papers'
      Parallax does); nothing after this call runs in the launching process.
    * In a plain ``python train.py`` without ``resources``: a one-worker run in this process.

    Seeds torch's global generator with `Config.seed` in every worker (`parallax.distribute`
    leaves the program's generator as it was instead).
    """
    return build_runner(model, optimizer, loss_fn, resources=resources, config=config,
                        seed=True)


def build_runner(model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
                 loss_fn: LossFn, *, resources: str | os.PathLike[str] | None,
                 config: Config | None, seed: bool) -> Runner:
    """`get_runner`; ``seed``: whether to seed torch's global generator with `Config.seed`."""
    config = config if config is not None else Config()
    if not isinstance(config, Config):
        raise ArgumentTypeError(f"config must be a parallax.Config, got {type(config).__name__}")
    optimizers = as_optimizer_list(optimizer)
    check_in_model(model, optimizers)
    worker = current_worker()
    if worker is None and resources is not None:
        _check_before_launch(model, optimizers, config)
        spec = parse_resources(resources)
        sys.exit(launch(spec, [sys.argv[0], *sys.argv[1:]]))
    if worker is None:
        worker = single_process_worker()
    install_error_recorder()
    if seed:
        torch.manual_seed(config.seed)
    group = join(worker, config)
    runner = Runner(model, optimizers, loss_fn, worker=worker, config=config,
                    sparse_group=group)
    verification = verify.active()
    if verification is not None:  # under parallax verify: the state at every step
        runner.step_hooks.append(RunRecorder(verification, runner))
    return runner


def _check_before_launch(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
                         config: Config) -> None:
    """Fail in the launching process, before any worker starts, on what workers would reject."""
    with tracing_once(model):  # both read the model's trace: one trace
        sparse = find_sparse_parameters(model)
        check_exact(model, sparse, config)
    held = server_held(model, sparse, config)
    check_not_compiled(model, [*sparse, *held])
    check_per_shard(optimizers, held)
    if config.lazy_sparse_updates:
        params = dict(model.named_parameters())
        check_lazy(optimizers, {name: params[name] for name in sparse})
