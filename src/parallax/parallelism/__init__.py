"""Parallelisms: how the dense layers are laid out over the processes (`Config.parallelism`).

A parallelism is one strategy object behind the contract `Parallelism`: the runner calls the
same methods whatever it is, so adding one is a file and an entry in `build_parallelism`.

* ``"data"`` (`DataParallel`, default): every process holds the whole dense model (DDP).
* ``"model"`` and ``"2d"`` (`ModelParallel`): a `Grid` of ``data x model`` processes; the
  linear layers split over each model group with DTensor, the batch over the data groups.
  ``"model"`` is the ``1 x P`` grid.
* ``"auto"``: the grid the cost model (`parallax.parallelism.cost`) predicts fastest for this
  model, the global batch and the α, β measured at start-up.

The global batch is the same under every grid: the `parallax.shard` loaders of the ``m``
processes of a model group all read the samples the ``m`` of them would read under data
parallelism (``m x b`` rows each), so changing the grid never changes what is trained.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from parallax.cluster import WorkerInfo
from parallax.collective import agree
from parallax.config import Config, ModelSplitName, ParallelismName
from parallax.engine.tables.exchange import Traffic
from parallax.errors import ConfigError
from parallax.lazy import submodule_attributes
from parallax.logs import log
from parallax.parallelism.cost import choose_grid, explain, measure_link, predict_grids
from parallax.parallelism.data_parallel import DataParallel
from parallax.parallelism.grid import Grid, build_mesh
from parallax.parallelism.model_parallel import ModelParallel
from parallax.runs import TrainingRun

__all__ = ["DataParallel", "Grid", "ModelParallel", "Parallelism", "build_parallelism"]


class Parallelism(Protocol):
    """What the runner asks of a parallelism (see `DataParallel` for the identity)."""

    grid: Grid
    replaces_ddp: bool  # it synchronises the dense gradients itself (no DDP)
    reduces_gradients: bool  # `reduce_gradients` has work to do (False: it is a no-op)
    sharded: dict[str, Any]  # split parameters by their name in the model

    def prepare(self, executed: nn.Module, model: nn.Module,
                optimizers: Sequence[torch.optim.Optimizer]) -> nn.Module: ...
    def counting(self) -> contextlib.AbstractContextManager[Any]: ...
    def reduce_gradients(self) -> None: ...
    def norm_parts(self) -> dict[str, Any]: ...
    def is_sharded(self, param: Tensor) -> bool: ...
    def bytes_per_step(self) -> dict[str, float]: ...
    def reset(self) -> None: ...
    def plain_model_state(self, state: dict[str, Tensor]) -> dict[str, Tensor]: ...
    def sharded_model_state(self, state: dict[str, Tensor]) -> dict[str, Tensor]: ...
    def load_plain_model_state(self, state: dict[str, Tensor]) -> dict[str, Tensor]: ...
    def plain_optimizer_state(self, optimizer: torch.optim.Optimizer,
                              state: dict[str, Any]) -> dict[str, Any]: ...
    def distribute_optimizer_state(self, optimizer: torch.optim.Optimizer) -> None: ...
    def describe(self) -> str: ...


def build_parallelism(model: nn.Module, config: Config, *, worker: WorkerInfo,
                      group: dist.ProcessGroup, traffic: Traffic,
                      run: TrainingRun) -> Parallelism:
    """The parallelism `Config.parallelism` names, its mesh built (collective); ``run``'s
    loaders read as its grid says."""
    from parallax.loader import clear_data_parallel, set_data_parallel

    kind = ParallelismName(config.parallelism)
    pairs = config.model_split == ModelSplitName.PAIRS
    world = worker.world_size
    if kind == ParallelismName.DATA:
        clear_data_parallel(run)
        return DataParallel(world)
    if kind == ParallelismName.MODEL:
        grid = Grid(1, world)
    elif kind == ParallelismName.TWO_D:
        assert config.mesh is not None  # Config requires it
        grid = Grid(*config.mesh)
    else:
        grid = _auto_grid(model, worker=worker, group=group, pairs=pairs, run=run)
    if grid.model == 1:
        clear_data_parallel(run)
        return DataParallel(world)
    mesh = build_mesh(grid, rank=worker.rank, world_size=world, device=worker.device,
                      timeout_s=config.collective_timeout_s)
    set_data_parallel(run, replicas=grid.data, index=mesh.data_index, group_size=grid.model)
    return ModelParallel(mesh, traffic=traffic, average=config.average_dense, rank=worker.rank,
                         find_unused_parameters=config.find_unused_parameters, pairs=pairs)


def _auto_grid(model: nn.Module, *, worker: WorkerInfo, group: dist.ProcessGroup,
               pairs: bool, run: TrainingRun) -> Grid:
    """The grid the cost model predicts fastest, on rank 0's measurements (every rank gets
    the same); prints its reasons on rank 0."""
    from parallax.loader import run_loaders, unbound_loaders

    # the run's loaders, or the ones made before distribute that no run holds yet
    loaders = run_loaders(run) + unbound_loaders()
    if not loaders:
        raise ConfigError("Config.parallelism='auto' needs the global batch: create the data "
                          "loader with parallax.shard before parallax.get_runner, or name a "
                          "grid (parallelism='data', 'model', or '2d' with Config.mesh)")
    batch = loaders[-1].global_batch
    link = measure_link(group, worker.world_size)
    decision = None
    if worker.rank == 0:
        predictions = predict_grids(model, worker.world_size, batch=batch, link=link,
                                    pairs=pairs)
        chosen = choose_grid(predictions)
        log.info("%s", explain(predictions, chosen, link, batch))
        decision = (chosen.grid.data, chosen.grid.model)
    data, model_degree = agree(decision, rank=worker.rank, group=group)
    return Grid(data, model_degree)

# submodules not imported above, as attributes on first use
__getattr__ = submodule_attributes(__name__)
