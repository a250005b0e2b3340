"""The dense-synchronisation contract, and the registry of every `Config.dense_sync` kind.

Two families implement it: the comm-hook kinds (``hierarchical``, ``flat``, ``qsgd``: DDP
AllReduces or gathers the gradients during the backward, `HookSync`) and the server kinds
(``plump``, ``slim``: each worker trains its own dense copy whose updates go through servers
at the end of a step, `ServerDenseSync`). The runner builds the one `DENSE_SYNCS` names once
and only calls the contract:

* ``module``: what the forward runs (the DDP wrapper, or the executed copy itself);
* ``end_step(step)``: after a step's updates (the server kinds' rounds);
* ``defer_backward()`` / ``riders()``: `Runner.step`'s backward may leave the dense sum to
  the push (`parallax.engine.dense_sync.deferred`), which carries the kind's riders;
* ``serving_global()``: while inside, the model holds the values training produced (the
  servers' under the server kinds, for evaluation and export);
* ``require_aggregated(what)``: refuse what needs one aggregated dense gradient;
* ``seconds`` / ``reset()``: time spent synchronising, for `Runner.dense_sync_seconds`.

A new kind is a class here (or a hook in `HOOKS` for a comm-hook kind) and a registry entry.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import nn

from parallax.cluster import WorkerInfo
from parallax.config import Config, DenseSyncName
from parallax.engine.dense_sync import HOOKS, SUMS_EXACTLY, codec_of, wrap_dense
from parallax.engine.dense_sync.deferred import DenseRider, can_defer
from parallax.engine.dense_sync.server_sync import ServerSync, build_server_sync
from parallax.engine.diagnostics.phases import PhaseClock
from parallax.engine.tables.exchange import Traffic
from parallax.engine.tables.riders import Rider
from parallax.errors import UnsupportedProgramError

__all__ = ["DENSE_SYNCS", "DenseSync", "HookSync", "ServerDenseSync", "build_dense_sync"]


class DenseSync:
    """The contract; as a class of its own: no synchronisation (no replicated dense
    parameter, or model parallelism reduces the gradients itself)."""

    #: the Plump-DP / Slim-DP servers' client (server kinds only)
    server: ServerSync | None = None
    #: synchronises through DDP's comm hooks (model parallelism replaces them)
    by_hook: ClassVar[bool] = False

    def __init__(self, executed: nn.Module, *, optimizers: Sequence[torch.optim.Optimizer],
                 config: Config, worker: WorkerInfo, group: dist.ProcessGroup,
                 traffic: Traffic, phases: PhaseClock) -> None:
        self.executed = executed
        self.phases = phases
        self.group = group
        self.module: nn.Module = executed
        self.config = config
        self.rank = worker.rank

    def end_step(self, step: int) -> None:
        """Step ``step``'s updates are done."""

    def defer_backward(self) -> None:
        """`Runner.step`'s backward comes, its push right after it: sum the dense gradients
        in the push where that is exact and saves a collective
        (`parallax.engine.dense_sync.deferred`)."""

    def riders(self) -> list[Rider]:
        """What the push carries for this kind (`parallax.engine.tables.riders`)."""
        return []

    def serving_global(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def require_aggregated(self, what: str, fix: str) -> None:
        """Refuse ``what`` where there is no aggregated dense gradient."""

    @property
    def seconds(self) -> float:
        return 0.0

    def reset(self) -> None:
        """Restart `seconds`."""

    def release(self) -> None:
        """At `parallax.shutdown`: the forward runs the executed copy again (a DDP wrapper
        kept alive past its process group fails in its destructor)."""
        self.module = self.executed


class HookSync(DenseSync):
    """``hierarchical``, ``flat``, ``qsgd``: DDP with the kind's comm hook (`HOOKS`)."""

    by_hook = True

    def __init__(self, executed: nn.Module, *, optimizers: Sequence[torch.optim.Optimizer],
                 config: Config, worker: WorkerInfo, group: dist.ProcessGroup,
                 traffic: Traffic, phases: PhaseClock) -> None:
        super().__init__(executed, optimizers=optimizers, config=config, worker=worker,
                         group=group, traffic=traffic, phases=phases)
        self.module, self.state = wrap_dense(
            executed, device=worker.device, sync=config.dense_sync,
            average=config.average_dense, find_unused_parameters=config.find_unused_parameters,
            traffic=traffic, qsgd=config.qsgd, seed=config.seed)

        dense = [p for p in executed.parameters() if p.requires_grad]
        self._deferrable = (
            self.state is not None and config.dense_sync == DenseSyncName.HIERARCHICAL
            and can_defer(dense, small_sums=self.state.small_sums,
                          find_unused_parameters=config.find_unused_parameters))
        self._dense = dense
        self._traffic = traffic
        self._world = worker.world_size
        #: steps whose dense sum rode in the push
        self.ridden = 0

    def defer_backward(self) -> None:
        if self._deferrable and self.state is not None:
            self.state.deferring = True

    def riders(self) -> list[Rider]:
        """The dense gradients the backward left for the push, if it left them."""
        state = self.state
        if state is None or not state.deferred:
            return []
        state.deferring = state.deferred = False
        self.ridden += 1
        return [DenseRider(self._dense, state.names, world=self._world,
                           average=self.config.average_dense, traffic=self._traffic)]

    def end_step(self, step: int) -> None:
        if self.state is not None:  # (a step whose backward raised leaves nothing armed)
            self.state.deferring = self.state.deferred = False

    @property
    def seconds(self) -> float:
        """0 for ``flat`` (asynchronous: it overlaps the backward)."""
        return self.state.seconds if self.state is not None else 0.0

    def reset(self) -> None:
        if self.state is not None:
            self.state.seconds = 0.0


class ServerDenseSync(DenseSync):
    """``plump``, ``slim``: see `parallax.engine.dense_sync.server_sync`."""

    def __init__(self, executed: nn.Module, *, optimizers: Sequence[torch.optim.Optimizer],
                 config: Config, worker: WorkerInfo, group: dist.ProcessGroup,
                 traffic: Traffic, phases: PhaseClock) -> None:
        super().__init__(executed, optimizers=optimizers, config=config, worker=worker,
                         group=group, traffic=traffic, phases=phases)
        self.server = build_server_sync(
            executed, optimizers, sync=str(config.dense_sync), slim=config.slim,
            codec=codec_of(config.qsgd), rank=worker.rank, world=worker.world_size,
            server_ranks=worker.server_ranks, group=group, traffic=traffic,
            average=config.average_dense, seed=config.seed)

    def end_step(self, step: int) -> None:
        if self.server is not None and step % self.config.slim.sync_every == 0:
            with self.phases.phase("dense sync"):
                self.server.communicate()

    def serving_global(self) -> contextlib.AbstractContextManager[None]:
        """The servers' dense values in the model while inside (collective)."""
        if self.server is None:
            return contextlib.nullcontext()
        return self.server.serving_global()

    def require_aggregated(self, what: str, fix: str) -> None:
        if self.server is not None:
            raise UnsupportedProgramError(
                f"rank {self.rank}: {what} under dense_sync={str(self.config.dense_sync)!r}: "
                f"{fix}")

    @property
    def seconds(self) -> float:
        """Time in the servers' rounds (core selection and exploration too)."""
        return self.server.seconds if self.server is not None else 0.0

    def reset(self) -> None:
        if self.server is not None:
            self.server.seconds = 0.0


#: every `Config.dense_sync` kind
DENSE_SYNCS: dict[DenseSyncName, type[DenseSync]] = {
    DenseSyncName.HIERARCHICAL: HookSync,
    DenseSyncName.FLAT: HookSync,
    DenseSyncName.QSGD: HookSync,
    DenseSyncName.PLUMP: ServerDenseSync,
    DenseSyncName.SLIM: ServerDenseSync,
}


def build_dense_sync(executed: nn.Module, *, replicated_dense: bool, hooks_replaced: bool,
                     optimizers: Sequence[torch.optim.Optimizer], config: Config,
                     worker: WorkerInfo, group: dist.ProcessGroup, traffic: Traffic,
                     phases: PhaseClock) -> DenseSync:
    """The kind `Config.dense_sync` names for ``executed`` (collective). None of it when the
    dense parameters are not replicated (``replicated_dense`` False: ps/optps pull them), no
    comm hook where model parallelism reduces the gradients itself (``hooks_replaced``), and
    none in a world of one whose hook sums exactly (`SUMS_EXACTLY`): one worker's gradient is
    the sum, so the backward is the program's own, with no DDP wrapper copying it into
    buckets and back."""
    name = DenseSyncName(config.dense_sync)
    kind = DENSE_SYNCS[name] if replicated_dense else DenseSync
    alone = worker.world_size == 1 and name in HOOKS and HOOKS[name] in SUMS_EXACTLY
    if kind.by_hook and (hooks_replaced or alone):
        kind = DenseSync
    return kind(executed, optimizers=optimizers, config=config, worker=worker, group=group,
                traffic=traffic, phases=phases)
