"""TorchRec as a peer system on the recommender workload (benchmarks/recsys.py).

The same model as ``recsys.RecModel``, but its tables live in a TorchRec ``EmbeddingBagCollection``
sharded by ``DistributedModelParallel`` on CPU (gloo): ``row_wise`` (each table split by rows over
all ranks) or ``table_wise`` (each table whole on one rank). The MLP is replicated (DMP wraps
it in DDP). Tables use TorchRec's fused (in-backward) optimizer kernels; the MLP a plain torch
optimizer. Gradient division stays on (TorchRec's default), so, like DDP and parallax, a step
uses the mean gradient of the global batch.

Notes on CPU: TorchRec only offers ROW_WISE for CUDA, so a sharder subclass adds it on CPU; row-wise
sharding requires the same batch size on every rank. If a sharding type cannot be built or run,
``make_torchrec_step`` raises ``PeerUnavailable`` carrying the exact error text.
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

from recsys import RecBatch, RecConfig, RecModel, mlp, rec_loss  # noqa: E402

SHARDINGS = {"torchrec-rw": "row_wise", "torchrec-tw": "table_wise"}
FEATURES = ("user", "item", "genre")


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


def to_kjt(inputs: tuple[Tensor, Tensor, Tensor, Tensor]) -> Any:
    """RecModel's plain inputs as a ``KeyedJaggedTensor`` with keys user, item, genre."""
    from torchrec import KeyedJaggedTensor

    users, items, genres, offsets = inputs
    b = users.shape[0]
    genre_lengths = torch.diff(offsets, append=torch.tensor([genres.numel()]))
    ones = torch.ones(b, dtype=torch.long)
    return KeyedJaggedTensor.from_lengths_sync(
        keys=list(FEATURES),
        values=torch.cat([users.reshape(-1), items.reshape(-1), genres]),
        lengths=torch.cat([ones, ones, genre_lengths]))


class TorchRecModel(nn.Module):
    """EmbeddingBagCollection (sum pooling) -> concat in FEATURES order -> ``recsys.mlp``."""

    def __init__(self, cfg: RecConfig, device: torch.device | None = None):
        super().__init__()
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType

        rows = {"user": cfg.user_rows, "item": cfg.item_rows, "genre": cfg.num_genres}
        self.ebc = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name=f"t_{f}", embedding_dim=cfg.emb,
                                       num_embeddings=rows[f], feature_names=[f],
                                       pooling=PoolingType.SUM) for f in FEATURES],
            device=device)
        self.mlp = mlp(cfg)

    def forward(self, kjt: Any) -> Tensor:
        pooled = self.ebc(kjt).to_dict()
        return self.mlp(torch.cat([pooled[f] for f in FEATURES], dim=1)).squeeze(1)


def _cpu_sharder() -> Any:
    """An EmbeddingBagCollectionSharder that also offers ROW_WISE on CPU."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.types import ShardingType

    class CPUEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder):
        def sharding_types(self, compute_device_type: str) -> list[str]:
            types = list(super().sharding_types(compute_device_type))
            for extra in (ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value):
                if extra not in types:
                    types.append(extra)
            return types

    return CPUEmbeddingBagCollectionSharder()


def _plan(model: TorchRecModel, sharding: str, world: int, sharder: Any) -> Any:
    """A sharding plan forcing ``sharding`` with the FUSED kernel on every table."""
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints

    constraints = {f"t_{f}": ParameterConstraints(sharding_types=[sharding],
                                                  compute_kernels=["fused"])
                   for f in FEATURES}
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world, compute_device="cpu"), constraints=constraints)
    # plan() on every rank (deterministic), not collective_plan(): a planning error then
    # happens on all ranks alike instead of leaving the others inside rank 0's broadcast.
    return planner.plan(model, [sharder])


@torch.no_grad()
def copy_weights(dmp: nn.Module, source: RecModel) -> None:
    """Loads ``source``'s weights into the sharded model: each rank writes its own shards (the
    state_dict's shards are views of the fused kernels' weights), the MLP is copied whole."""
    state = dmp.state_dict()
    for name, tensor in source.state_dict().items():
        table = name.split(".")[0]
        if table in FEATURES:
            target = state[f"ebc.embedding_bags.t_{table}.weight"]
            for shard in target.local_shards():
                (row, col), (rows, cols) = (shard.metadata.shard_offsets,
                                            shard.metadata.shard_sizes)
                shard.tensor.copy_(tensor[row:row + rows, col:col + cols])
        else:
            state[name].copy_(tensor)


def _agree(failed: bool) -> bool:
    """True if any rank failed (every rank calls this once per build, failed or not)."""
    flag = torch.tensor([float(failed)])
    dist.all_reduce(flag)
    return bool(flag.item())


def make_torchrec_step(system: str, cfg: RecConfig, optimizer: str = "adagrad",
                       lr: float = 0.05, seed: int = 0,
                       ) -> Callable[[RecBatch], Tensor]:
    """``step(batch) -> loss`` for ``system`` in SHARDINGS, inside an initialised gloo group.
    ``optimizer``: "adagrad" or "sgd" (tables: the fused kernel's equivalent). Raises
    PeerUnavailable with the exact error when the configuration cannot be built
    (building only: a failure in a later step raises the kernel's own error)."""
    if system not in SHARDINGS:
        raise ValueError(f"unknown TorchRec system {system!r}; known: {sorted(SHARDINGS)}")
    stage = "import"
    try:
        import torchrec.distributed.comm_ops as comm_ops
        from torchrec.distributed import DistributedModelParallel
        from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
        from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
        from torchrec.optim.optimizers import in_backward_optimizer_filter

        stage = "shard"
        comm_ops.set_gradient_division(True)  # mean over the global batch, like DDP
        opt_cls = {"adagrad": torch.optim.Adagrad, "sgd": torch.optim.SGD}[optimizer]
        torch.manual_seed(seed)
        model = TorchRecModel(cfg, device=torch.device("meta"))
        apply_optimizer_in_backward(opt_cls, model.ebc.parameters(), {"lr": lr})
        sharder = _cpu_sharder()
        plan = _plan(model, SHARDINGS[system], dist.get_world_size(), sharder)
        dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan,
                                       sharders=[sharder])
        dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                      lambda params: opt_cls(params, lr=lr))
        opt = CombinedOptimizer([dmp.fused_optimizer, dense])
        stage = "copy weights"
        torch.manual_seed(seed)
        copy_weights(dmp, RecModel(cfg))  # the same start as make_rec_step's RecModel
    except Exception as error:
        traceback.print_exc()
        _agree(failed=True)
        raise PeerUnavailable(system, stage, error) from error
    if _agree(failed=False):
        raise PeerUnavailable(system, "shard", RuntimeError("another rank failed to build"))

    def step(batch: RecBatch) -> Tensor:
        inputs, labels = batch
        opt.zero_grad()
        loss = rec_loss(dmp(to_kjt(inputs)), labels)
        loss.backward()
        opt.step()
        return loss.detach()

    step.model = dmp  # type: ignore[attr-defined]
    step.plan = plan  # type: ignore[attr-defined]
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


def main(argv: list[str] | None = None) -> None:
    """Smoke comparison on MovieLens-100k, run under ``parallax run`` or ``torchrun``:
    every system trains from the same seed on the same shards; prints losses and step times."""
    import argparse
    import statistics
    import time
    from datetime import timedelta

    from recsys import batches, load_movielens, make_rec_step

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--systems", nargs="+",
                        default=["hybrid", "ddp-dense", "torchrec-rw", "torchrec-tw"])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=256, help="per worker")
    parser.add_argument("--emb", type=int, default=32)
    parser.add_argument("--hash-multiplier", type=int, default=1)
    parser.add_argument("--optimizer", choices=["adagrad", "sgd"], default="adagrad")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--synthetic", action="store_true", help="no download")
    args = parser.parse_args(argv)

    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = RecConfig(batch=args.batch, emb=args.emb, hash_multiplier=args.hash_multiplier)
    if args.synthetic:
        from recsys import synthetic_movielens
        data = synthetic_movielens(20_000)
    else:
        if rank == 0:
            load_movielens()  # downloads once; the others wait
        dist.barrier()
        data = load_movielens()
    shards = batches(data, cfg, rank, world, seed=0)
    for system in args.systems:
        try:
            kwargs = {"optimizer": args.optimizer, "lr": args.lr}
            step = (make_torchrec_step(system, cfg, **kwargs) if system in SHARDINGS
                    else make_rec_step(system, cfg, **kwargs))
        except PeerUnavailable as error:
            if rank == 0:
                print(f"[recsys] {system}: UNAVAILABLE {error.as_dict()}", flush=True)
            continue
        if rank == 0 and system in SHARDINGS:
            print(f"[recsys] {system} plan: {plan_summary(step.plan)}", flush=True)
        times, losses = [], []
        for i in range(args.warmup + args.steps):
            start = time.perf_counter()
            losses.append(float(step(shards[i % len(shards)])))
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
        stats = torch.tensor([statistics.median(times), sum(losses[:5]) / 5,
                              sum(losses[-5:]) / 5], dtype=torch.float64)
        dist.all_reduce(stats)
        stats /= world
        if rank == 0:
            print(f"[recsys] {system}: {stats[0] * 1e3:.1f} ms/step (median over ranks' "
                  f"medians), loss first5 {stats[1]:.4f} last5 {stats[2]:.4f}", flush=True)
        dist.barrier()
    try:
        import parallax
        parallax.shutdown()
    except Exception:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
