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
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workloads import LMConfig, SampledSoftmaxLM, sampled_softmax_loss, zipf_lm_batch  # noqa: E402

import parallax  # noqa: E402
from parallax.cluster import current_worker  # noqa: E402


def link_bytes() -> int:
    stats = Path("/sys/class/net/eth0/statistics")
    if not stats.exists():  # not in an emulated machine: nothing to read
        return 0
    return int((stats / "tx_bytes").read_text()) + int((stats / "rx_bytes").read_text())


def make_step(system: str, cfg: LMConfig):
    """A ``step(batch) -> loss`` for ``system``, built from the same single-device program."""
    cfg = replace(cfg, sparse_grad=system == "ddp-sparse")
    torch.manual_seed(0)
    model = SampledSoftmaxLM(cfg)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)
    if system.startswith("ddp"):
        ddp = DistributedDataParallel(model)

        def step(batch):
            (tokens, candidates), targets = batch
            optimizer.zero_grad(set_to_none=True)
            loss = sampled_softmax_loss(ddp(tokens, candidates), targets)
            loss.backward()
            optimizer.step()
            return loss

        return step
    runner = parallax.get_runner(model, optimizer, sampled_softmax_loss,
                                 config=parallax.Config(architecture=system,
                                                        sparsity_warmup_steps=2))
    return runner.step


def main() -> None:
    args = json.loads(sys.argv[1])
    cfg = LMConfig(**args["workload"])
    worker = current_worker()
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    results = []
    for system in args["systems"]:
        step = make_step(system, cfg)
        generator = torch.Generator().manual_seed(1000 + worker.rank)
        for _ in range(args["warmup"]):
            step(zipf_lm_batch(cfg, generator))
        dist.barrier()
        before, times = link_bytes(), []
        for _ in range(args["steps"]):
            batch = zipf_lm_batch(cfg, generator)
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
            "words_per_s": worker.world_size * cfg.batch * cfg.seq_len / median,
            "wire_bytes_per_machine_step": float(wire[0]) / machines / args["steps"],
        })
        if worker.rank == 0:
            print(f"[bench] {system}: {median * 1e3:.0f} ms/step", flush=True)
    if worker.rank == 0:
        Path(args["out"]).write_text(json.dumps(results, indent=1))
    parallax.shutdown()


if __name__ == "__main__":
    main()
