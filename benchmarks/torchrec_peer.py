"""TorchRec as a peer system: the benchmark workloads built the way a TorchRec user would.

Recommender (benchmarks/recsys.py): the same model as ``recsys.RecModel``, its tables in a TorchRec
``EmbeddingBagCollection``. LM (benchmarks/workloads.py): see ``torchrec_lm.py``, which uses the
helpers here. Tables are sharded by ``DistributedModelParallel`` on CPU (gloo): ``row_wise`` (each
table split by rows over all ranks), ``table_wise`` (each table whole on one rank) or, for
``torchrec-plan``, whatever TorchRec's own planner picks per table (row-, table-, column-wise or
data-parallel). The dense part is replicated (DMP wraps it in DDP). Tables use TorchRec's fused
(in-backward) optimizer kernels; the dense part a plain torch optimizer. Gradient division stays
on (TorchRec's default), so, like DDP and parallax, a step uses the mean gradient of the global
batch. Index dedup (``EmbeddingCollectionSharder(use_index_dedup=True)``) is not offered: its
kernel ``fbgemm::jagged_unique_indices`` has no CPU implementation in fbgemm-gpu-cpu 1.8.0.

Notes on CPU: TorchRec offers ROW_WISE for bags only on CUDA, so a sharder subclass adds it on
CPU; row-wise sharding requires the same batch size on every rank. If a sharding type cannot be
built, ``make_torchrec_step`` raises ``PeerUnavailable`` carrying the exact error text.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from recsys import RecConfig, RecModel, mlp, rec_loss  # noqa: E402

# system -> the sharding type forced on every table; None: TorchRec's planner picks per table
SHARDINGS: dict[str, str | None] = {"torchrec-rw": "row_wise", "torchrec-tw": "table_wise",
                                    "torchrec-cw": "column_wise", "torchrec-plan": None}
FEATURES = ("user", "item", "genre")
OPTIMIZERS = {"adagrad": torch.optim.Adagrad, "sgd": torch.optim.SGD}


class PeerUnavailable(RuntimeError):
    """A TorchRec configuration that cannot run here; ``str(self)`` is the exact error."""

    def __init__(self, system: str, stage: str, error: BaseException):
        self.system, self.stage = system, stage
        self.error = f"{type(error).__name__}: {error}"
        super().__init__(f"{system} ({stage}): {self.error}")

    def as_dict(self) -> dict[str, str]:
        return {"system": self.system, "stage": self.stage, "error": self.error}


def torchrec_available() -> bool:
    """True when torchrec and fbgemm-gpu import (bench-only dependencies)."""
    try:
        import fbgemm_gpu  # noqa: F401
        import torchrec  # noqa: F401
    except Exception:  # ImportError, or fbgemm's own OSError on a missing library
        return False
    return True


def features(cfg: RecConfig) -> tuple[str, ...]:
    """The model's features in concat order: FEATURES, and "history" with a history bag."""
    return (*FEATURES, "history") if cfg.history else FEATURES


def to_kjt(inputs: tuple[Tensor, ...]) -> Any:
    """RecModel's plain inputs as a ``KeyedJaggedTensor`` with keys user, item, genre (and
    history, when the inputs carry one)."""
    from torchrec import KeyedJaggedTensor

    users, items, genres, offsets = inputs[:4]
    b = users.shape[0]
    genre_lengths = torch.diff(offsets, append=torch.tensor([genres.numel()]))
    ones = torch.ones(b, dtype=torch.long)
    values, lengths = [users.reshape(-1), items.reshape(-1), genres], [ones, ones, genre_lengths]
    keys = list(FEATURES)
    if len(inputs) > 4:
        history = inputs[4]
        values.append(history.reshape(-1))
        lengths.append(torch.full((b,), history.shape[1], dtype=torch.long))
        keys.append("history")
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.cat(values),
                                               lengths=torch.cat(lengths))


class TorchRecModel(nn.Module):
    """EmbeddingBagCollection (sum pooling) -> concat in FEATURES order -> ``recsys.mlp``."""

    def __init__(self, cfg: RecConfig, device: torch.device | None = None):
        super().__init__()
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType

        rows = {"user": cfg.user_rows, "item": cfg.item_rows, "genre": cfg.num_genres,
                "history": cfg.item_rows}
        self.features = features(cfg)
        self.ebc = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name=f"t_{f}", embedding_dim=cfg.emb,
                                       num_embeddings=rows[f], feature_names=[f],
                                       pooling=PoolingType.SUM) for f in self.features],
            device=device)
        self.mlp = mlp(cfg)

    def forward(self, kjt: Any) -> Tensor:
        pooled = self.ebc(kjt).to_dict()
        return self.mlp(torch.cat([pooled[f] for f in self.features], dim=1)).squeeze(1)


def _cpu_sharder(model: nn.Module) -> Any:
    """The sharder for ``model``'s EmbeddingCollection (sequence) or EmbeddingBagCollection,
    also offering ROW_WISE on CPU (the bag sharder lists it for CUDA only)."""
    from torchrec import EmbeddingCollection
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.types import ShardingType

    sequence = any(isinstance(m, EmbeddingCollection) for m in model.modules())
    base = EmbeddingCollectionSharder if sequence else EmbeddingBagCollectionSharder

    class CPUSharder(base):  # type: ignore[misc, valid-type]
        def sharding_types(self, compute_device_type: str) -> list[str]:
            types = list(super().sharding_types(compute_device_type))
            if ShardingType.ROW_WISE.value not in types:
                types.append(ShardingType.ROW_WISE.value)
            return types

    return CPUSharder()


def _plan(model: nn.Module, tables: list[str], sharding: str | None, world: int,
          sharder: Any) -> Any:
    """A sharding plan with the FUSED kernel on every table and ``sharding`` forced on all of
    them (None: the planner's own choice per table, among the types the sharder offers)."""
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints

    constraints = {t: ParameterConstraints(sharding_types=[sharding] if sharding else None,
                                           compute_kernels=["fused"])
                   for t in tables}
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world, compute_device="cpu"), constraints=constraints)
    # plan() on every rank (deterministic), not collective_plan(): a planning error then
    # happens on all ranks alike instead of leaving the others inside rank 0's broadcast.
    return planner.plan(model, [sharder])


@torch.no_grad()
def load_weights(dmp: nn.Module, weights: dict[str, Tensor]) -> None:
    """Loads full tensors, keyed like ``dmp.state_dict()``, into the sharded model: each rank
    writes its own shards of a table (the state_dict's shards are views of the fused kernels'
    weights); replicated tensors are copied whole."""
    state = dmp.state_dict()
    for name, tensor in weights.items():
        target = state[name]
        if not hasattr(target, "local_shards"):
            target.copy_(tensor)
            continue
        for shard in target.local_shards():
            (row, col), (rows, cols) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            shard.tensor.copy_(tensor[row:row + rows, col:col + cols])


def _agree(failed: bool) -> bool:
    """True if any rank failed (every rank calls this once per build, failed or not)."""
    flag = torch.tensor([float(failed)])
    dist.all_reduce(flag)
    return bool(flag.item())


def build_sharded(system: str, make_model: Callable[[torch.device], nn.Module],
                  tables: list[str], weights: Callable[[], dict[str, Tensor]],
                  optimizer: str = "adagrad", lr: float = 0.05,
                  ) -> tuple[nn.Module, Any, Any]:
    """``(dmp, optimizer, plan)``: ``make_model(meta)`` under DistributedModelParallel with
    ``tables`` sharded per ``system``, the fused ``optimizer`` on the tables and the plain one
    on the rest, starting from ``weights()`` (full tensors keyed like the DMP's state_dict).
    Inside an initialised gloo group; every rank raises PeerUnavailable if any rank fails."""
    if system not in SHARDINGS:
        raise ValueError(f"unknown TorchRec system {system!r}; known: {sorted(SHARDINGS)}")
    stage = "import"
    try:
        import torchrec.distributed.comm_ops as comm_ops
        from torchrec import EmbeddingBagCollection, EmbeddingCollection
        from torchrec.distributed import DistributedModelParallel
        from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
        from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
        from torchrec.optim.optimizers import in_backward_optimizer_filter

        stage = "model"
        opt_cls = OPTIMIZERS[optimizer]
        model = make_model(torch.device("meta"))
        stage = "shard"
        comm_ops.set_gradient_division(True)  # mean over the global batch, like DDP
        # torch's Adagrad eps (fbgemm's default is 1e-8), so the tables update as on one device
        fused = {"lr": lr, **({"eps": 1e-10} if opt_cls is torch.optim.Adagrad else {})}
        for module in model.modules():
            if isinstance(module, (EmbeddingBagCollection, EmbeddingCollection)):
                apply_optimizer_in_backward(opt_cls, module.parameters(), fused)
        sharder = _cpu_sharder(model)
        plan = _plan(model, tables, SHARDINGS[system], dist.get_world_size(), sharder)
        dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan,
                                       sharders=[sharder])
        dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                      lambda params: opt_cls(params, lr=lr))
        opt = CombinedOptimizer([dmp.fused_optimizer, dense])
        stage = "copy weights"
        load_weights(dmp, weights())
    except Exception as error:
        traceback.print_exc()
        _agree(failed=True)
        raise PeerUnavailable(system, stage, error) from error
    if _agree(failed=False):
        raise PeerUnavailable(system, "shard", RuntimeError("another rank failed to build"))
    return dmp, opt, plan


def rec_weights(cfg: RecConfig, seed: int = 0) -> dict[str, Tensor]:
    """``RecModel(cfg)``'s weights after ``torch.manual_seed(seed)`` (the harness's start),
    keyed like TorchRecModel's sharded state_dict."""
    torch.manual_seed(seed)
    weights = {}
    for name, tensor in RecModel(cfg).state_dict().items():
        table = name.split(".")[0]
        weights[f"ebc.embedding_bags.t_{table}.weight" if table in features(cfg)
                else name] = tensor
    return weights


def make_torchrec_step(system: str, cfg: Any, optimizer: str = "adagrad", lr: float = 0.05,
                       seed: int = 0) -> Callable[[Any], Tensor]:
    """``step(batch) -> loss`` for ``system`` in SHARDINGS, inside an initialised gloo group:
    the recommender for a ``RecConfig``, the LM (``torchrec_lm``) for an ``LMConfig``, the
    NMT (``torchrec_nmt``) for an ``NMTConfig``; the
    batch is the workload's own. ``optimizer``: "adagrad" or "sgd" (tables: the fused kernel's
    equivalent). Raises PeerUnavailable with the exact error when the configuration cannot be
    built (building only: a failure in a later step raises the kernel's own error)."""
    if not isinstance(cfg, RecConfig):
        from nmt import NMTConfig
        from torchrec_lm import make_torchrec_lm_step
        from torchrec_nmt import make_torchrec_nmt_step
        from workloads import LMConfig

        makers = {LMConfig: make_torchrec_lm_step, NMTConfig: make_torchrec_nmt_step}
        if type(cfg) not in makers:
            raise TypeError(f"TorchRec peer: no model for {type(cfg).__name__}")
        return makers[type(cfg)](system, cfg, optimizer=optimizer, lr=lr, seed=seed)
    dmp, opt, plan = build_sharded(
        system, lambda device: TorchRecModel(cfg, device=device),
        [f"t_{f}" for f in features(cfg)], lambda: rec_weights(cfg, seed), optimizer, lr)

    return training_step(dmp, opt, plan, to_kjt, rec_loss)


def training_step(dmp: nn.Module, opt: Any, plan: Any, to_input: Callable[[Any], Any],
                  loss_fn: Callable[[Tensor, Tensor], Tensor]) -> Callable[[Any], Tensor]:
    """``step((inputs, targets)) -> loss`` of a sharded TorchRec model, with the model, its
    plan and ``to_input`` attached for inspection and evaluation."""

    def step(batch: Any) -> Tensor:
        inputs, targets = batch
        opt.zero_grad()
        loss = loss_fn(dmp(to_input(inputs)), targets)
        loss.backward()
        opt.step()
        return loss.detach()

    step.model = dmp  # type: ignore[attr-defined]
    step.plan = plan  # type: ignore[attr-defined]
    step.to_input = to_input  # type: ignore[attr-defined]  (the model's input: quality.py)
    return step


def plan_summary(plan: Any) -> dict[str, str]:
    """``{table: "sharding_type kernel ranks=[...] rows=[...]"}`` from a ShardingPlan."""
    out = {}
    for module_plan in plan.plan.values():
        for table, ps in module_plan.items():
            shards = ps.sharding_spec.shards if ps.sharding_spec else []
            out[table] = (f"{ps.sharding_type} {ps.compute_kernel} ranks={ps.ranks} "
                          f"rows={[s.shard_sizes[0] for s in shards]}")
    return out
