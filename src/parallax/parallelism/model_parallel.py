"""`ModelParallel`: linear layers split over a model group, the batch over data groups.

Built on torch's DTensor tensor parallelism (``parallelize_module`` with the styles of
`parallax.parallelism.splits`) over the ``"model"`` dimension of a `Grid`'s mesh; the forward
and backward collectives of a split layer are DTensor's. What torch lacks, written here:

* the data-parallel reduction of the split weights' gradients over the ``"data"``
  communicator. DDP refuses DTensor parameters, and its private ``_pre_dp_module_transform``
  re-creates the Parameter objects on every forward, so the user's optimizer would step stale
  ones; FSDP2's ``fully_shard`` would shard the weights over ``data`` too (another memory
  layout, and reduce-scatter, which gloo lacks). One flat all-reduce per dtype after the
  backward, as DDP's single bucket would do;
* the bookkeeping that keeps the single-device program's view: the user's optimizer steps the
  DTensor parameters (its param groups are re-pointed, its state distributed alike);
  ``state_dict``, checkpoints and optimizer state dicts hold whole tensors (gathered with
  ``full_tensor``) and are loaded back by slicing locally, so a checkpoint resumes on another
  grid;
* the byte counts per communicator (`parallax.parallelism.comm_count`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from parallax.checks import is_dtensor
from parallax.engine.tables.exchange import Traffic
from parallax.engine.tables.handles import release
from parallax.errors import UnsupportedProgramError
from parallax.parallelism.comm_count import CollectiveCounter
from parallax.parallelism.grid import Mesh
from parallax.parallelism.splits import LinearSplit, Split, plan_splits, styles

if TYPE_CHECKING:  # imported where a grid is built: 0.7 s of the parallax command's start-up
    from torch.distributed.tensor import DTensor

__all__ = ["ModelParallel", "ShardedGradNorm"]

#: `Runner.stats` names of the bytes each communicator moves
MODEL_TRAFFIC = "activations (model group)"
DATA_TRAFFIC = "dense gradients (data group)"


class ShardedGradNorm:
    """A split parameter's part of the global gradient norm, in the shape of a server table
    (`parallax.engine.optimizers.grad_norm` sums ``grad_norm_squared`` over all ranks): its local
    shard's squared norm divided by the number of ranks holding that same shard (every data
    replica, and every rank of the model group where it is replicated, as a row split's
    bias is), and a ``scale_grad`` of the local shard."""

    def __init__(self, name: str, param: DTensor, data: int) -> None:
        self.name, self.param = name, param
        mesh = param.device_mesh
        self.copies = data
        for dim, placement in enumerate(param.placements):
            if placement.is_replicate():
                self.copies *= mesh.size(dim)

    def grad_norm_squared(self) -> Tensor:
        grad = self.param.grad
        if grad is None:
            return torch.zeros((), dtype=torch.float64)
        squared: Tensor = torch.linalg.vector_norm(_local(grad), dtype=torch.float64) ** 2
        return squared / self.copies

    def scale_grad(self, factor: Tensor) -> None:
        if self.param.grad is not None:
            local = _local(self.param.grad)
            local.mul_(factor.to(local.dtype))

    def clamp_grad(self, value: float) -> None:
        if self.param.grad is not None:
            _local(self.param.grad).clamp_(-value, value)


class ModelParallel:
    """The ``model`` and ``2d`` parallelisms (a `Grid` with a model degree above 1): see the
    module docstring. ``traffic`` receives the bytes of both communicators."""

    replaces_ddp = True
    reduces_gradients = True

    def __init__(self, mesh: Mesh, *, traffic: Traffic, average: bool, rank: int,
                 find_unused_parameters: bool = False, pairs: bool = True) -> None:
        self.mesh = mesh
        self.pairs = pairs  # Config.model_split: "pairs", else every layer gathered
        self.find_unused_parameters = find_unused_parameters
        self.grid = mesh.grid
        self.traffic = traffic
        self.average = average
        self.rank = rank
        self.splits: list[LinearSplit] = []
        self.sharded: dict[str, DTensor] = {}   # split parameters by their model name
        self.dense: dict[str, nn.Parameter] = {}  # every trainable parameter of the module
        self._norm_parts: dict[str, ShardedGradNorm] = {}  # built once the splits exist
        self.counter = CollectiveCounter({mesh.model_group.group_name: self.grid.model})
        self.steps = 0
        self.data_sent = 0.0
        self._model_recorded = 0.0  # of the counter's bytes, those already in `traffic`

    # ---- building ----------------------------------------------------------------------
    def prepare(self, executed: nn.Module, model: nn.Module,
                optimizers: Sequence[torch.optim.Optimizer]) -> nn.Module:
        """Split ``executed``'s linear layers over the model group (in place), re-point
        ``optimizers`` at the split parameters and release the user's whole copies."""
        self.splits = plan_splits(executed, self.grid.model, pairs=self.pairs)
        before = dict(executed.named_parameters())
        users = dict(model.named_parameters())
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(executed, self.mesh.model_mesh, styles(self.splits))
        after = dict(executed.named_parameters())
        for name, param in after.items():
            if not is_dtensor(param):
                continue
            old = before[name]
            if users.get(name) is not old:
                raise UnsupportedProgramError(
                    f"rank {self.rank}: parameter {name!r} of the split layer is not the "
                    f"model's own parameter of that name; model parallelism needs each split "
                    f"linear layer's parameters to be its own")
            _repoint(optimizers, old, param)
            self.sharded[name] = param
            # the user's module keeps a storage-less handle (engine.handles)
            release(old, name=name, rank=self.rank, device=param.device)
        self.dense = {n: p for n, p in executed.named_parameters() if p.requires_grad}
        self._norm_parts = {name: ShardedGradNorm(name, p, self.grid.data)
                            for name, p in self.sharded.items()}
        return executed

    # ---- training ----------------------------------------------------------------------
    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Count the model group's collectives of a forward and backward inside."""
        with self.counter:
            yield

    def reduce_gradients(self) -> None:
        """Sum (or average) every dense gradient over the data group: one flat all-reduce
        per dtype. Each rank holds its model index's shards, the same in every data group."""
        self.steps += 1
        self._record_model()
        if self.grid.data == 1:
            return
        grads = [_local(grad) for p in self._with_gradients() if (grad := p.grad) is not None]
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for grad in grads:
            by_dtype.setdefault(grad.dtype, []).append(grad)
        for same in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in same])
            dist.all_reduce(flat, group=self.mesh.data_group)
            if self.average:
                flat /= self.grid.data
            self._record_data(flat.numel() * flat.element_size())
            offset = 0
            for grad in same:
                grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
                offset += grad.numel()

    def _with_gradients(self) -> list[nn.Parameter]:
        """The dense parameters to reduce, the same list on every rank of the data group.
        With `Config.find_unused_parameters`, one small all-reduce says which got a gradient
        on some rank; a rank whose part of the batch did not use one reduces zeros for it
        (its gradient on one device is the other parts' sum). Otherwise every parameter must
        have one: a rank without refuses, naming it, instead of sending a shorter buffer."""
        if not self.find_unused_parameters:
            missing = [name for name, p in self.dense.items() if p.grad is None]
            if missing:
                raise UnsupportedProgramError(
                    f"rank {self.rank}: parameter(s) {missing} got no gradient in this step; "
                    f"the data groups of model/2-D parallelism reduce every dense "
                    f"gradient, so a parameter this rank's part of the batch did not use needs "
                    f"Config(find_unused_parameters=True) (one more small all-reduce per step)")
            return list(self.dense.values())
        params = list(self.dense.values())
        used = torch.tensor([p.grad is not None for p in params], dtype=torch.int32)
        dist.all_reduce(used, group=self.mesh.data_group)
        for param, count in zip(params, used.tolist(), strict=True):
            if count and param.grad is None:
                param.grad = torch.zeros_like(param)
        return [p for p, count in zip(params, used.tolist(), strict=True) if count]

    def _record_data(self, payload: int) -> None:
        ranks = self.grid.data_group_ranks(self.mesh.model_index)
        n = len(ranks)
        volume = 2 * (n - 1) * payload // n
        self.data_sent += volume
        self.traffic.record_ring(DATA_TRAFFIC, volume, ranks)

    def _record_model(self) -> None:
        """This step's model-group bytes (the counter's) into `traffic`, so `Runner.stats`
        and the intra/inter-machine split see them too."""
        total = sum(self.counter.sent.values())
        volume = int(round(total - self._model_recorded))
        self._model_recorded = total
        if volume:
            self.traffic.record_ring(MODEL_TRAFFIC, volume,
                                     self.grid.model_group_ranks(self.mesh.data_index))

    def norm_parts(self) -> dict[str, ShardedGradNorm]:
        """The split parameters' parts of the global norm (see `ShardedGradNorm`)."""
        return self._norm_parts

    def is_sharded(self, param: Tensor) -> bool:
        return is_dtensor(param)

    def bytes_per_step(self) -> dict[str, float]:
        """Bytes this rank sent per training step through each communicator (``"model"``:
        DTensor's collectives of forwards and backwards, ``"data"``: the gradients'
        all-reduce), since the start or the last `reset`."""
        steps = max(self.steps, 1)
        return {"model": sum(self.counter.sent.values()) / steps,
                "data": self.data_sent / steps}

    def reset(self) -> None:
        self.steps = 0
        self.data_sent = 0.0
        self._model_recorded = 0.0
        self.counter.sent.clear()
        self.counter.calls.clear()

    # ---- the single-device view ---------------------------------------------------------
    def plain_model_state(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """``state`` (the user's model's state dict) with each split parameter whole
        (collective within the model group)."""
        state = dict(state)
        for name in sorted(self.sharded):
            with torch.no_grad():
                state[name] = self.sharded[name].full_tensor()
        return state

    def sharded_model_state(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """``state`` with each split parameter as this rank's DTensor, not gathered: the
        DTensors that train (``sharded``, which `plain_model_state` gathers), not what the
        module's own ``state_dict`` holds under those names (meta tensors, found in
        ``save_dcp``'s first run)."""
        return {**state, **{name: param.detach() for name, param in self.sharded.items()}}

    def load_plain_model_state(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """Each split parameter takes its shard of ``state``'s whole value (local slicing);
        returns the rest of ``state``, for the user's module."""
        for name, param in self.sharded.items():
            if name in state:
                with torch.no_grad():
                    param.to_local().copy_(self._distribute(state[name], param).to_local())
        return {k: v for k, v in state.items() if k not in self.sharded}

    def plain_optimizer_state(self, optimizer: torch.optim.Optimizer,
                              state: dict[str, Any]) -> dict[str, Any]:
        """``optimizer``'s state dict ``state`` with the split parameters' state whole."""
        out = {**state, "state": dict(state["state"])}
        for index in sorted(out["state"]):
            entry = out["state"][index]
            if any(is_dtensor(v) for v in entry.values()):
                out["state"][index] = {k: v.full_tensor() if is_dtensor(v) else v
                                       for k, v in entry.items()}
        return out

    def distribute_optimizer_state(self, optimizer: torch.optim.Optimizer) -> None:
        """After loading a whole (single-device) state dict into ``optimizer``: each split
        parameter's per-element state becomes its shard."""
        for group in optimizer.param_groups:
            for param in group["params"]:
                if is_dtensor(param) and param in optimizer.state:
                    optimizer.state[param] = {
                        k: self._distribute(v, param)
                        if isinstance(v, Tensor) and not is_dtensor(v)
                        and v.shape == param.shape else v
                        for k, v in optimizer.state[param].items()}

    def _distribute(self, whole: Tensor, like: DTensor) -> DTensor:
        from torch.distributed.tensor import distribute_tensor

        # src_data_rank=None: every rank slices its own copy, no collective
        return distribute_tensor(whole.to(like.dtype), like.device_mesh, like.placements,
                                 src_data_rank=None)

    def describe(self) -> str:
        """One line per linear layer: how it is split."""
        lines = [f"parallelism: grid {self.grid}"]
        for s in self.splits:
            lines.append(f"  {s.path}: Linear({s.in_features}, {s.out_features}) {s.split}"
                         + ("" if s.split == Split.REPLICATED else
                            f" over {self.grid.model} processes"))
        return "\n".join(lines)


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if is_dtensor(tensor) else tensor


def _repoint(optimizers: Sequence[torch.optim.Optimizer], old: nn.Parameter,
             new: DTensor) -> None:
    """Every optimizer holding ``old`` steps ``new`` instead, with ``old``'s state sliced."""
    from torch.distributed.tensor import distribute_tensor

    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for i, param in enumerate(group["params"]):
                if param is old:
                    group["params"][i] = new
                    if old in optimizer.state:
                        optimizer.state[new] = {
                            k: distribute_tensor(v, new.device_mesh, new.placements,
                                                 src_data_rank=None)
                            if isinstance(v, Tensor) and v.shape == old.shape else v
                            for k, v in optimizer.state.pop(old).items()}
