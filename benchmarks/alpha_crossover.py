"""Where does AllReduce beat the PS for a sparse parameter? Step time against α.

Runs on a local cluster of 2 machines x 2 workers (processes of one host talking over
loopback: no bandwidth limit, 4 processes sharing this machine's cores) a model with one
embedding table (ROWS x DIM, float32) and a small dense layer, where every worker uses exactly
α·ROWS rows per step; once with the table on the PS (hybrid, local aggregation) and once moved to
AllReduce after one warm-up step, and reports the median step time of each. Adam on a
dense-gradient table: every row moves every step in both, as on one device.

    python benchmarks/alpha_crossover.py            # writes benchmarks/out/alpha_crossover.json
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import records

ROWS, DIM, BATCH, STEPS = 50_000, 64, 8, 12
ALPHAS = [0.005, 0.02, 0.05, 0.1, 0.2, 0.4, 0.7, 1.0]
HERE = Path(__file__).resolve().parent


def worker(out: str) -> None:
    import torch
    from torch import nn

    import parallax

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding = nn.Embedding(ROWS, DIM)
            self.dense = nn.Linear(DIM, 16)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.dense(self.embedding(ids).mean(dim=1))

    results = []
    for alpha in ALPHAS:
        for placement, threshold in (("ps", 1.0), ("allreduce", 0.0)):
            torch.manual_seed(0)
            model = Model()
            # (rows pulled or AllReduced: the crossover measured; its bags would pool)
            config = parallax.Config(sparsity_warmup_steps=1, alpha_threshold=threshold,
                                     pooled_tables=())
            runner = parallax.get_runner(model, torch.optim.Adam(model.parameters(), lr=1e-3),
                                         nn.functional.cross_entropy, config=config)
            used = max(1, int(alpha * ROWS))
            gen = torch.Generator().manual_seed(runner.worker.rank)
            times = []
            for step in range(STEPS):
                ids = torch.randperm(ROWS, generator=gen)[:used].reshape(1, -1)
                batch = (ids.repeat(BATCH, 1), torch.randint(0, 16, (BATCH,), generator=gen))
                start = time.perf_counter()
                runner.step(batch)
                times.append(time.perf_counter() - start)
                if step == 1:
                    runner.reset_stats()  # bytes of the settled placement only
            plan = {p.name: p for p in runner.plan.parameters}["embedding.weight"]
            results.append({"alpha": alpha, "placement": placement, "sync": plan.sync,
                            "measured_alpha": plan.alpha,
                            "median_step_s": statistics.median(times[2:]),
                            "inter_machine_bytes": sum(runner.inter_machine_bytes().values())})
    if runner.worker.rank == 0:
        Path(out).write_text(json.dumps(results, indent=1))
    parallax.shutdown()


def main() -> None:
    out = records.scratch() / "alpha_crossover.json"
    out.parent.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "parallax.cli", "run", "--machines", "2",
           "--nproc-per-machine", "2", __file__, "--worker", str(out)]
    subprocess.run(cmd, check=True)
    results = json.loads(out.read_text())
    print("| alpha | PS step (ms) | AllReduce step (ms) | PS bytes/machine/step | "
          "AllReduce bytes/machine/step |")
    print("|---|---|---|---|---|")
    for alpha in ALPHAS:
        ps, ar = (next(r for r in results if r["alpha"] == alpha and r["placement"] == p)
                  for p in ("ps", "allreduce"))
        print(f"| {alpha} | {1e3 * ps['median_step_s']:.1f} | {1e3 * ar['median_step_s']:.1f} "
              f"| {ps['inter_machine_bytes']:,.0f} | {ar['inter_machine_bytes']:,.0f} |")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker(sys.argv[sys.argv.index("--worker") + 1])
    else:
        main()
