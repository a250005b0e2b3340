"""The per-parameter plan: how each parameter is synchronised, where it lives, what it costs.

Besides the decision, every parameter carries its size, its measured α (sparse parameters, once
the warm-up steps have run) and the inter-machine bytes per machine and step that the papers'
Table 3 predicts under each of the four architectures (`parallax.planning.cost`), and the time
those bytes take on the link (`parallax.planning.link`: given or measured), so the plan answers
"why is this faster" with numbers that `Runner.stats()` measures.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

from torch import nn

from parallax.engine.tables.layout import REPLICATED, Placement
from parallax.engine.tables.sharding import Sharding
from parallax.model.detect import SparseUse
from parallax.partitions.tuner import SearchRecord
from parallax.planning import cost
from parallax.planning.architectures import ARCHITECTURES, ParameterCost
from parallax.planning.link import Link
from parallax.planning.sparsity import Sparsity


@dataclass(frozen=True)
class ParameterPlan:
    """One parameter's decision.

    ``sync`` is ``"allreduce"`` (replicated on every worker, gradients AllReduced),
    ``"allgatherv"`` (replicated, gradient rows exchanged as (ids, rows) with every worker) or
    ``"ps"`` (rows partitioned over the servers, pulled and pushed per step).
    ``predicted_bytes`` maps each architecture to the predicted inter-machine bytes per machine
    and step (None for a sparse parameter whose α is not measured yet).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    sync: str
    reason: str
    sparse: bool = False
    #: how its rows are held and read: its table's sharding
    #: (`parallax.engine.tables.sharding`: ``rows``, ``pooled``, ``pooled_by_rows``,
    #: ``pooled_by_columns``, ``replicated``, ``own``); None: a parameter no table holds
    sharding: str | None = None
    partitions: int = 0
    server_ranks: tuple[int, ...] = ()
    bytes: int = 0
    alpha: float | None = None
    alpha_machine: float | None = None
    predicted_bytes: dict[str, float | None] = field(default_factory=dict)

    @property
    def placement(self) -> str:
        if self.sync == "ps":
            return (f"PS: {self.partitions} partition(s) on server rank(s) "
                    f"{','.join(map(str, self.server_ranks))}")
        if self.sync == "allgatherv":
            return "replicated, AllGatherv of rows"
        return "replicated, AllReduce"


@dataclass(frozen=True)
class Plan:
    """All parameters' decisions, printable for people (`table`) and tools (`to_json`)."""

    parameters: tuple[ParameterPlan, ...]
    world_size: int
    num_machines: int
    architecture: str = "hybrid"
    searches: tuple[SearchRecord, ...] = ()
    #: the link the predicted times assume (`parallax.planning.link`); None: not known yet
    #: (measured after the warm-up) or one machine
    link: Link | None = None

    @property
    def alpha_model(self) -> float | None:
        """Element-weighted mean α over all trainable parameters (dense ones count as 1)."""
        alphas = [(math.prod(p.shape), p.alpha if p.sparse else 1.0) for p in self.parameters]
        if any(alpha is None for _, alpha in alphas):
            return None
        total = sum(size for size, _ in alphas)
        used = sum(size * alpha for size, alpha in alphas if alpha is not None)
        return used / total if total else None

    def predicted_total(self, architecture: str) -> float | None:
        values = [p.predicted_bytes.get(architecture) for p in self.parameters]
        known = [v for v in values if v is not None]
        return None if len(known) < len(values) else sum(known)

    def seconds(self, bytes_per_step: float | None) -> float | None:
        """The link time of ``bytes_per_step`` inter-machine bytes per machine (0 on one
        machine; None while the link or the bytes are unknown)."""
        if self.num_machines == 1 and bytes_per_step is not None:
            return 0.0
        return None if self.link is None else self.link.seconds(bytes_per_step)

    @classmethod
    def build(cls, model: nn.Module, sparse: dict[str, SparseUse], *,
              placements: dict[str, Placement], world_size: int, num_machines: int,
              architecture: str = "hybrid", sparsity: dict[str, Sparsity] | None = None,
              reasons: dict[str, str] | None = None, local_aggregation: bool | None = None,
              searches: tuple[SearchRecord, ...] = (), small_sums: bool = False,
              flat_dense: bool = False,
              shardings: dict[str, Sharding] | None = None,
              link: Link | None = None) -> Plan:
        """``placements[name]`` for every parameter held otherwise than replicated and
        AllReduced; ``sparsity`` once measured; ``reasons`` to note a decision taken on it;
        ``local_aggregation`` as `Config.local_aggregation` (None: each architecture's
        default); ``searches`` how the partition groups' counts were chosen; ``small_sums``:
        the run sums small AllReduce payloads by one all_to_all (`cost.Shape.small_sums`);
        ``flat_dense``: its dense gradients go by one ring over every rank
        (`Config.dense_sync` ``"flat"``, `cost.Shape.flat_dense`);
        ``shardings``: each table's sharding (`parallax.engine.tables.sharding`; a parameter
        without one is replicated, or a dense one pulled whole), recorded by name;
        ``link``: what the predicted times assume."""
        shape = cost.Shape(num_machines, max(1, world_size // num_machines),
                           small_sums=small_sums, flat_dense=flat_dense)
        dense_payload = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                            if p.requires_grad and n not in sparse)
        sparsity = sparsity or {}
        shardings = shardings or {}
        entries = []
        for name, param in model.named_parameters():
            if not param.requires_grad:
                continue
            use = sparse.get(name)
            reason = "dense" if use is None else _sparse_reason(use)
            if reasons and name in reasons:
                reason += f"; {reasons[name]}"
            sync, partitions, servers = placements.get(name, REPLICATED)
            measured = sparsity.get(name)
            sharding = shardings.get(name)
            pools = sharding is not None and sharding.pools
            if (measured is not None and measured.bags is not None and measured.bag_ids
                    is not None and not pools and sync == "ps"):
                row_bytes = param.numel() * param.element_size() / max(param.shape[0], 1)
                pooled_bytes = cost.pooled_bags(measured.bag_ids, measured.bags, row_bytes,
                                                shape)
                reason += f"; pooled on an owner: {_size(pooled_bytes)}/step (pooled_tables)"

            entries.append(ParameterPlan(
                name=name, shape=tuple(param.shape),
                dtype=str(param.dtype).removeprefix("torch."), sync=sync, reason=reason,
                sparse=use is not None,
                sharding=None if sharding is None else sharding.name,
                partitions=partitions, server_ranks=servers,
                bytes=param.numel() * param.element_size(),
                alpha=measured.alpha if measured else None,
                alpha_machine=measured.alpha_machine if measured else None,
                predicted_bytes=_predictions(param, use is not None, measured, sync, shape,
                                             local_aggregation, dense_payload,
                                             sharding=sharding, servers=len(servers))))
        return cls(tuple(entries), world_size, num_machines, architecture, searches, link)

    def table(self) -> str:
        header = ("parameter", "shape", "bytes", "kind", "alpha", "why", "lives on",
                  *(f"{a} B/step" for a in map(str, ARCHITECTURES)),
                  f"{self.architecture} link time/step")
        rows = [(p.name, "x".join(map(str, p.shape)) or "scalar", _size(p.bytes),
                 "sparse" if p.sparse else "dense", _alpha(p), p.reason, p.placement,
                 *(_size(p.predicted_bytes.get(a)) for a in map(str, ARCHITECTURES)),
                 _time(self.seconds(p.predicted_bytes.get(self.architecture))))
                for p in self.parameters]
        widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
        lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                 for r in (header, *rows)]
        lines.insert(1, "  ".join("-" * w for w in widths))
        alpha_model = self.alpha_model
        title = (f"parallax plan ({self.architecture}): {self.world_size} worker(s) on "
                 f"{self.num_machines} machine(s), "
                 f"{sum(p.sparse for p in self.parameters)} sparse parameter(s), alpha_model "
                 f"{'not measured yet' if alpha_model is None else f'{alpha_model:.3f}'}")
        totals = ", ".join(f"{a} {_size(self.predicted_total(a))}" for a in map(str, ARCHITECTURES))
        footer = (f"predicted inter-machine bytes per machine and step (B/step columns: per "
                  f"parameter, papers' Table 3 for this engine): {totals}")
        return "\n".join([title, *lines, footer, self._times_line(),
                          *(record.summary() for record in self.searches)])

    def _times_line(self) -> str:
        if self.num_machines == 1:
            return "predicted link time per step: none (one machine)"
        if self.link is None:
            return ("predicted link time per step: ? (the link is measured after the warm-up; "
                    "or set Config.link_gbit)")
        times = ", ".join(f"{a} {_time(self.seconds(self.predicted_total(a)))}"
                          for a in map(str, ARCHITECTURES))
        return (f"predicted link time per step (the bytes at the {self.link.describe()}): "
                f"{times}")

    def to_json(self) -> str:
        return json.dumps({
            "architecture": self.architecture, "world_size": self.world_size,
            "num_machines": self.num_machines, "alpha_model": self.alpha_model,
            "predicted_bytes": {a: self.predicted_total(a) for a in map(str, ARCHITECTURES)},
            "link": None if self.link is None else asdict(self.link),
            "predicted_seconds": {a: self.seconds(self.predicted_total(a))
                                  for a in map(str, ARCHITECTURES)},
            "parameters": [{**asdict(p), "predicted_seconds": {
                a: self.seconds(b) for a, b in p.predicted_bytes.items()}}
                for p in self.parameters],
            "partition_searches": [record.to_dict() for record in self.searches],
        }, indent=2)


def _predictions(param: nn.Parameter, is_sparse: bool, measured: Sparsity | None, sync: str,
                 shape: cost.Shape, local_aggregation: bool | None,
                 dense_payload: float, *, sharding: Sharding | None = None,
                 servers: int = 1) -> dict[str, float | None]:
    """Each architecture's predicted bytes for ``param`` (`Architecture.predicted_bytes`);
    ``dense_payload``: the bytes of all dense gradients, summed together; ``sharding``: its
    table's, on ``servers`` servers (pooled by rows or columns: every one of them pools)."""
    pooled = sharding is not None and sharding.pools
    spread = sharding is not None and (sharding.by_rows or sharding.slices > 1)
    rows = param.shape[0] if param.dim() else 1
    used = used_machine = None
    if is_sparse and measured is not None:
        used = measured.alpha * rows
        k = shape.workers_per_machine
        machine_alpha = (measured.alpha_machine if measured.alpha_machine is not None
                         else 1 - (1 - measured.alpha) ** k)  # independent workers' union
        used_machine = machine_alpha * rows
    sized = ParameterCost(rows=rows, row_bytes=param.numel() * param.element_size() / max(rows, 1),
                          sparse=is_sparse, used=used, used_machine=used_machine, sync=sync,
                          payload=None if is_sparse else dense_payload,
                          bag_ids=measured.bag_ids if measured else None,
                          bags=measured.bags if measured else None, pooled=pooled,
                          pooled_owners=servers if spread else 1,
                          pooled_by_columns=sharding is not None and sharding.slices > 1)
    return {str(name): architecture.predicted_bytes(sized, shape,
                                                    local_aggregation=local_aggregation)
            for name, architecture in ARCHITECTURES.items()}


def _sparse_reason(use: SparseUse) -> str:
    reason = {"embedding": "nn.Embedding", "embedding_bag": "nn.EmbeddingBag",
              "gather": "row gathers only (fx trace)"}[use.kind]
    return reason + (", sparse grad" if use.sparse_grad else "")


def _alpha(p: ParameterPlan) -> str:
    if not p.sparse:
        return "1"
    return "?" if p.alpha is None else f"{p.alpha:.3f}"


def _time(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    if seconds == 0:
        return "0"
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} us"


def _size(value: float | None) -> str:
    if value is None:
        return "?"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f} B"
