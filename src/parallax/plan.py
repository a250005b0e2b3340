"""The per-parameter plan: how each parameter is synchronised and where it lives."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from torch import nn

from parallax.analysis import SparseUse


@dataclass(frozen=True)
class ParameterPlan:
    """One parameter's decision.

    ``sync`` is ``"allreduce"`` (replicated on every worker, gradients AllReduced by DDP),
    ``"allgatherv"`` (replicated, gradient rows exchanged as (ids, rows) with every worker) or
    ``"ps"`` (rows partitioned over the servers, pulled and pushed per step).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    sync: str
    reason: str
    sparse: bool = False
    partitions: int = 0
    server_ranks: tuple[int, ...] = ()

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

    @classmethod
    def build(cls, model: nn.Module, sparse: dict[str, SparseUse], *,
              placements: dict[str, tuple[str, int, tuple[int, ...]]], world_size: int,
              num_machines: int) -> Plan:
        """``placements[name] = (sync, partitions, server_ranks)`` for every parameter held
        otherwise than replicated-and-AllReduced."""
        entries = []
        for name, param in model.named_parameters():
            if not param.requires_grad:
                continue
            use = sparse.get(name)
            if use is None:
                reason = "dense"
            else:
                reason = {"embedding": "nn.Embedding", "embedding_bag": "nn.EmbeddingBag",
                          "gather": "row gathers only (fx trace)"}[use.kind]
                if use.sparse_grad:
                    reason += ", sparse grad"
            sync, partitions, servers = placements.get(name, ("allreduce", 0, ()))
            entries.append(ParameterPlan(
                name=name, shape=tuple(param.shape),
                dtype=str(param.dtype).removeprefix("torch."), sync=sync, reason=reason,
                sparse=use is not None, partitions=partitions, server_ranks=servers))
        return cls(tuple(entries), world_size, num_machines)

    def table(self) -> str:
        header = ("parameter", "shape", "dtype", "kind", "why", "lives on")
        rows = [(p.name, "x".join(map(str, p.shape)) or "scalar", p.dtype,
                 "sparse" if p.sparse else "dense", p.reason, p.placement)
                for p in self.parameters]
        widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
        lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                 for r in (header, *rows)]
        lines.insert(1, "  ".join("-" * w for w in widths))
        title = (f"parallax plan: {self.world_size} worker(s) on {self.num_machines} "
                 f"machine(s), {sum(p.sparse for p in self.parameters)} sparse parameter(s)")
        return "\n".join([title, *lines])

    def to_json(self) -> str:
        return json.dumps({"world_size": self.world_size, "num_machines": self.num_machines,
                           "parameters": [asdict(p) for p in self.parameters]}, indent=2)
