"""Worker of benchmarks/compare.py: trains the workload under each system in turn, inside one
group of processes, and records step times and the bytes on this machine's link.

Systems: parallax's four architectures, and PyTorch DDP over the whole model with a
dense-gradient embedding (what most users run) or with ``sparse=True`` (gloo AllReduces the
sparse gradient). Run through ``parallax run --emulate-network``; arguments come as JSON.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workloads import Workload  # noqa: E402

import parallax  # noqa: E402
from parallax.cluster import current_worker  # noqa: E402


def link_bytes() -> int:
    stats = Path("/sys/class/net/eth0/statistics")
    if not stats.exists():  # not in an emulated machine: nothing to read
        return 0
    return int((stats / "tx_bytes").read_text()) + int((stats / "rx_bytes").read_text())


def make_step(system: str, workload: Workload):
    """A ``step(batch) -> loss`` for ``system``, built from the same single-device program.
    ``-sparse`` systems run the program with ``sparse=True`` embeddings, ``-lazy`` ones the
    dense-gradient program with ``Config(lazy_sparse_updates=True)``; ``torchrec-*`` the
    recommender as a TorchRec EmbeddingBagCollection (row- or table-wise sharded)."""
    if system.startswith("torchrec"):
        from torchrec_peer import make_torchrec_step

        return make_torchrec_step(system, workload.cfg, lr=workload.lr)
    sparse_grad = system.endswith("-sparse")
    model, optimizer = workload.model_and_optimizer(sparse_grad=sparse_grad)
    if system.startswith("ddp"):
        ddp = DistributedDataParallel(model)

        def step(batch):
            inputs, targets = batch
            inputs = inputs if isinstance(inputs, tuple) else (inputs,)
            optimizer.zero_grad(set_to_none=True)
            loss = workload.loss(ddp(*inputs), targets)
            loss.backward()
            optimizer.step()
            return loss

        return step
    architecture, _, variant = system.partition("-")
    runner = parallax.get_runner(model, optimizer, workload.loss,
                                 config=parallax.Config(architecture=architecture,
                                                        lazy_sparse_updates=variant == "lazy",
                                                        sparsity_warmup_steps=2))
    return runner.step


def main() -> None:
    args = json.loads(sys.argv[1])
    worker = current_worker()
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    workload = Workload(args.get("workload_name", "lm"), args["workload"])
    results = []
    for system in args["systems"]:
        try:
            step = make_step(system, workload)
        except Exception as error:  # a peer that cannot run here: record the exact error
            if not system.startswith("torchrec"):
                raise
            results.append({"system": system, "unavailable": f"{type(error).__name__}: "
                                                            f"{error}"})
            continue
        generator = torch.Generator().manual_seed(1000 + worker.rank)
        for _ in range(args["warmup"]):
            step(workload.batch(generator))
        dist.barrier()
        before, times = link_bytes(), []
        for _ in range(args["steps"]):
            batch = workload.batch(generator)
            start = time.perf_counter()
            step(batch)
            times.append(time.perf_counter() - start)
        dist.barrier()
        wire = torch.tensor([float(link_bytes() - before) if worker.is_server else 0.0,
                             statistics.median(times)], dtype=torch.float64)
        dist.all_reduce(wire)
        machines = len(worker.server_ranks)
        median = float(wire[1]) / worker.world_size
        results.append({
            "system": system, "median_step_s": median,
            "items_per_s": worker.world_size * workload.items / median,
            "unit": workload.unit,
            "wire_bytes_per_machine_step": float(wire[0]) / machines / args["steps"],
        })
        if worker.rank == 0:
            print(f"[bench] {system}: {median * 1e3:.0f} ms/step", flush=True)
    if worker.rank == 0:
        Path(args["out"]).write_text(json.dumps(results, indent=1))
    parallax.shutdown()


if __name__ == "__main__":
    main()
