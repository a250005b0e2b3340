"""`Grid`: the process grid of data × model parallelism, and the mesh it builds.

Ranks are laid out row-major over ``(data, model)``: rank ``r`` is at data index ``r // m``
and model index ``r % m``. So a model group is ``m`` consecutive ranks, which `parallax run`
places on one machine when it has that many workers: the collectives of every layer
(Table "model" of the cost model) stay inside machines, and only the weight gradients cross
them (as torchtitan lays out its tensor-parallel dimension innermost, for the same reason).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from parallax.checks import is_int
from parallax.errors import ConfigError

__all__ = ["Grid", "Mesh", "build_mesh"]


@dataclass(frozen=True)
class Grid:
    """``data`` replicas of the model, each split over ``model`` processes."""

    data: int
    model: int

    def __post_init__(self) -> None:
        for name in ("data", "model"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ConfigError(f"Config.mesh: the {name} degree must be an int >= 1, "
                                  f"got {value!r}")

    @property
    def size(self) -> int:
        return self.data * self.model

    def data_index(self, rank: int) -> int:
        return rank // self.model

    def model_index(self, rank: int) -> int:
        return rank % self.model

    def model_group_ranks(self, data_index: int) -> list[int]:
        return [data_index * self.model + m for m in range(self.model)]

    def data_group_ranks(self, model_index: int) -> list[int]:
        return [d * self.model + model_index for d in range(self.data)]

    def __str__(self) -> str:
        return f"{self.data}x{self.model} (data x model)"


@dataclass
class Mesh:
    """The built grid: torch's ``DeviceMesh`` (dimensions named ``"data"`` and ``"model"``),
    this rank's two communicators and where it sits."""

    grid: Grid
    device_mesh: DeviceMesh
    data_group: dist.ProcessGroup
    model_group: dist.ProcessGroup
    data_index: int
    model_index: int

    @property
    def model_mesh(self) -> DeviceMesh:
        return self.device_mesh["model"]


_meshes: dict[Grid, Mesh] = {}


def build_mesh(grid: Grid, *, rank: int, world_size: int, device: torch.device,
               timeout_s: float) -> Mesh:
    """Both communicators of ``grid`` (collective over all ranks), with the run's collective
    timeout, and a ``DeviceMesh`` over them. The groups are ours rather than
    ``init_device_mesh``'s: that one creates them with the backend's default timeout (30
    minutes for gloo) instead of `Config.collective_timeout_s`.

    Built once per grid and process, as the hybrid's own group is (`parallax.session`):
    DTensor caches its sharding decisions by mesh, and two meshes of one layout compare
    equal, so a second mesh's collectives could run on the first one's groups anyway."""
    if grid in _meshes:
        return _meshes[grid]
    if grid.size != world_size:
        raise ConfigError(f"Config.mesh {grid.data}x{grid.model} has {grid.size} processes, "
                          f"but the run has {world_size} workers: the data and model degrees "
                          f"must multiply to the number of workers")
    timeout = timedelta(seconds=timeout_s)
    model_ranks = [grid.model_group_ranks(d) for d in range(grid.data)]
    data_ranks = [grid.data_group_ranks(m) for m in range(grid.model)]
    model_group, _ = dist.new_subgroups_by_enumeration(model_ranks, timeout=timeout)
    data_group, _ = dist.new_subgroups_by_enumeration(data_ranks, timeout=timeout)
    layout = torch.arange(world_size).view(grid.data, grid.model)
    device_mesh = DeviceMesh.from_group([data_group, model_group], device.type, mesh=layout,
                                        mesh_dim_names=("data", "model"))
    mesh = Mesh(grid, device_mesh, data_group, model_group, grid.data_index(rank),
                grid.model_index(rank))
    _meshes[grid] = mesh
    return mesh


def forget_meshes() -> None:
    """At `parallax.shutdown`: the groups are destroyed with the default group."""
    _meshes.clear()
