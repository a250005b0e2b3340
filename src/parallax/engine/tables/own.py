"""A table that is the program's own parameter: a world of one, with nothing to exchange.

With one worker no row crosses a wire and every gradient is already the global one, so the
exact step is the single-device program's own: the layer reads its weight as the user's
module would (``F.embedding`` / ``F.embedding_bag`` over the whole weight), autograd writes
the weight's gradient, and the user's optimizer steps it with the dense parameters. Nothing
is deduplicated, pushed or updated row by row: the host does what the plain loop does
(`benchmarks/host_work.py` counts it). The table is still a table for what a run needs of
one (the plan, checkpoints in the common ``replica.pt`` format, the single-device state
dict), so a checkpoint written here resumes on any cluster shape.

It serves lookups whose gradient the plain layer makes densely and whose options do not
depend on the batch; a ``sparse=True`` layer, ``max_norm`` or ``scale_grad_by_freq`` keep
the replica of `parallax.engine.tables.replicated`, and so does a large table whose
optimizer leaves a row with a zero gradient as it is (its touched rows are cheaper:
`parallax.planning.sparsity.own_table_chosen`). Implements `parallax.engine.tables.table.Table`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from parallax.cluster import WorkerInfo
from parallax.engine.tables.bag_use import BagUse
from parallax.engine.tables.pool import SERIAL, PartitionPool
from parallax.engine.tables.riders import Rider
from parallax.engine.tables.sharding import OWN, Sharding
from parallax.engine.tables.verdict import Verdict
from parallax.errors import InternalError, SparseIdError

__all__ = ["OwnTable"]


class OwnTable:
    """The one worker's table: the parameter itself, read and stepped as on one device."""

    on_servers = False
    exchanges = False
    local_aggregation = False
    sharding: Sharding = OWN
    pool: PartitionPool = SERIAL
    sync = "allgatherv"  # the plan's word for a replica (one worker: nothing is gathered)
    sparse_grad = False
    batch_dependent = None
    average = False  # a world of one: the sum is the mean

    def __init__(self, name: str, param: nn.Parameter, *, worker: WorkerInfo) -> None:
        if worker.world_size != 1:
            raise InternalError(f"'{name}': the program's own table needs a world of one "
                                f"(got {worker.world_size} workers); please report it")
        self._hold(name, param, worker)

    def _hold(self, name: str, param: nn.Parameter, worker: WorkerInfo) -> None:
        """What a table that is the program's own parameter knows of it (also
        `parallax.engine.tables.own_summed.SummedOwnTable`'s, on several workers)."""
        self.name = name
        self.param = param
        self.worker = worker
        self.num_rows = param.shape[0]
        self.row_shape = tuple(param.shape[1:])
        self.dtype = param.dtype
        self.measuring = False  # (made after the warm-up measured α)
        self.rows_used: list[int] = []
        self.machine_rows_used: list[int] = []
        self.bag_use = BagUse()

    @property
    def held(self) -> None:
        return None

    @property
    def shard(self) -> None:
        return None

    @property
    def replica(self) -> nn.Parameter:
        """The parameter itself: the user's optimizer updates it."""
        return self.param

    def lookup(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """The whole weight and the ids themselves: the stand-in's ``F.embedding(ids,
        weight)`` is then the user's layer's own read, its gradient autograd's (an id outside
        the table fails there: `bad_id` names it)."""
        return self.param, ids

    def bad_id(self, ids: Tensor) -> SparseIdError:
        """The error for ``ids``, which hold one outside the table, named as on the servers
        (read only on that failure: nothing is checked ahead, as in the plain layer)."""
        low, high = torch.stack(torch.aminmax(ids.detach().reshape(-1))).tolist()
        return SparseIdError(
            f"parallax: sparse parameter '{self.name}' got id {low if low < 0 else high} on "
            f"rank {self.worker.rank} (machine {self.worker.machine}), outside its rows "
            f"[0, {self.num_rows})")

    def named_bad_id(self, ids: object) -> SparseIdError | None:
        """`bad_id` where a failed read of ``ids`` can be named here: a tensor on the CPU (on
        a GPU an id outside the table is a device-side assert, no IndexError); None
        otherwise. The one rule of the layer's read in the executed copy and of the
        program's own module (`parallax.step.forward.ProgramForward`)."""
        if isinstance(ids, Tensor) and ids.device.type == "cpu":
            return self.bad_id(ids)
        return None

    def read_rows(self, ids: Tensor, source: Tensor | None = None) -> Tensor:
        return self.param.detach()[ids]

    def pool_bags(self, ids: Tensor, offsets: Tensor | None, per_sample_weights: Tensor | None, *,
                  mode: str, padding_idx: int | None, include_last_offset: bool) -> Tensor:
        raise InternalError(f"'{self.name}' is the program's own parameter: its bags are "
                            "pooled by its layer, not on an owner; please report it")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing of the table's own: the weight's gradient is cleared with the dense
        parameters' (it is in the runner's replicated list)."""

    def push_gradients(self) -> None:
        """Nothing to push: autograd wrote the weight's gradient."""

    @staticmethod
    def push_together(tables: Sequence[OwnTable], verdict: Verdict | None = None,
                      riders: Sequence[Rider] = ()) -> None:
        """Nothing to push."""

    def pending_rows(self) -> list[Tensor]:
        return []

    def touched_rows(self) -> None:
        """Not known: the gradient is autograd's dense one (the update reads every row, as
        on one device)."""
        return None

    def grad_norm_squared(self) -> Tensor:
        """Zero: the weight's gradient counts once, with the dense ones."""
        return torch.zeros((), dtype=torch.float64, device=self.param.device)

    def scale_grad(self, factor: Tensor) -> None:
        """Nothing: the runner scales the weight's gradient with the dense ones."""

    def clamp_grad(self, value: float) -> None:
        """Nothing: the runner clamps the weight's gradient with the dense ones."""

    def full_weight(self, source: Tensor | None = None) -> Tensor:
        return (self.param if source is None else source).detach().clone()

    def assign(self, weight: Tensor) -> None:
        with torch.no_grad():
            self.param.copy_(weight.detach().view_as(self.param))
