"""Worker of the byte-accounting tests: one dense and one sparse parameter of known sizes, ids
chosen so that every worker uses exactly USED rows per step and the two workers of a machine
share USED - SHIFT of them. Trains under every architecture (and the hybrid without local
aggregation) and saves, on rank 0, each run's measured and predicted inter-machine bytes.

Usage: parallax run --machines 2 --nproc-per-machine 2 traffic_worker.py OUT.json"""

import json
import sys

import torch
from torch import Tensor, nn

import parallax
from parallax.launch.fast_exit import exit_now

ROWS, DIM, USED, SHIFT, STEPS, BATCH = 1000, 16, 40, 20, 6, 4
TRIAL_STEPS = 8  # warm-up 2, the trial's 2 + 2, then 2 with its choice
RUNS = {"allreduce": {}, "ps": {}, "optps": {}, "hybrid": {},
        "hybrid-nolocalagg": {"local_aggregation": False},
        "hybrid-flat": {"dense_sync": "flat"},  # the dense part by one ring over every rank
        # seed 001's operation placements moved back (its ablation's baselines)
        "ps-afterworkers": {"after_aggregation": "workers"},
        "ps-dedupservers": {"id_dedup": "servers"}}
# The default hybrid where the workers of a machine share no row: merging saves nothing, so the
# leader hop is dropped once α_m is measured (bytes counted after the warm-up only).
APART = "hybrid-apart"


class Model(nn.Module):
    def __init__(self, rows: int = ROWS, dim: int = DIM) -> None:
        super().__init__()
        self.embedding = nn.Embedding(rows, dim)
        self.dense = nn.Linear(dim, 64)

    def forward(self, ids: Tensor) -> Tensor:
        return self.dense(self.embedding(ids).mean(dim=1))


def batch(step: int, worker: parallax.cluster.WorkerInfo,
          shift: int = SHIFT) -> tuple[Tensor, Tensor]:
    """USED consecutive ids (half of them on each of 2 partitions), shifted by ``shift``
    between the workers of a machine and far apart between machines."""
    start = (step * 97 + worker.machine * 300 + worker.local_rank * shift) % ROWS
    ids = (start + torch.arange(USED)) % ROWS
    return ids.repeat(BATCH, 1), torch.randint(0, 64, (BATCH,))


def hop_trial() -> dict:
    """The default hybrid keeps the hop here by bytes, then times it (2 steps with, 2
    without: `parallax.step.aggregation_trial`); trained on as long as a run without the
    hop, whose parameters it must equal (the same sums in another order)."""
    states, out = {}, {}
    for run, extra in (("trial", {"local_aggregation_trial_steps": 2}),
                       ("direct", {"local_aggregation": False})):
        torch.manual_seed(0)
        model = Model().double()  # float64: the orders of the sums differ by ~1e-16
        runner = parallax.get_runner(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                     nn.functional.cross_entropy,
                                     config=parallax.Config(sparsity_warmup_steps=2, **extra))
        for step in range(TRIAL_STEPS):
            if run == "trial" and step == 2:
                out["settled_in_trial"] = runner.plan_settled  # α measured, trial begun
            ids, labels = batch(step, runner.worker)
            runner.step((ids, labels))
        states[run] = runner.state_dict()
        if run == "trial":
            trial = runner.planner.trial
            out.update(samples={str(k): v for k, v in trial.samples.items()},
                       local_aggregation=runner.local_aggregation,
                       settled=runner.plan_settled,
                       reason={p.name: p.reason for p in runner.plan.parameters})
    out["max_difference"] = max(float((states["trial"][k] - states["direct"][k]).abs().max()
                                       / states["direct"][k].abs().max())
                                for k in states["direct"])
    return out


def narrow_table(rows: int) -> dict:
    """Rows of 4 bytes, all used every step: the PS's 8-byte ids cost more than the rows.
    With 40,000 rows the gradient is summed by a ring, the bytes model prefers AllReduce and
    the default hybrid moves the table there; with 64 rows it would be summed by one
    all_to_all (`parallax.engine.tables.reduction`), whose copies to every rank cost more
    than the PS: it stays."""
    torch.manual_seed(0)
    model = Model(rows=rows, dim=1)
    runner = parallax.get_runner(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                 nn.functional.cross_entropy,
                                 config=parallax.Config(sparsity_warmup_steps=2))
    for _ in range(3):
        runner.step((torch.arange(rows).repeat(BATCH, 1), torch.randint(0, 64, (BATCH,))))
    plan = {p.name: p for p in runner.plan.parameters}["embedding.weight"]
    return {"sync": plan.sync, "reason": plan.reason, "alpha": plan.alpha}


def main() -> None:
    results, states = {}, {}
    for run, extra in [*RUNS.items(), (APART, {})]:
        torch.manual_seed(0)
        model = Model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        # the bytes rule alone (the leader hop's timed trial: tests/integration/test_traffic.py)
        config = parallax.Config(architecture=run.split("-")[0], sparsity_warmup_steps=2,
                                 local_aggregation_trial_steps=0, **extra)
        runner = parallax.get_runner(model, optimizer, nn.functional.cross_entropy,
                                     config=config)
        shift = USED if run == APART else SHIFT
        for step in range(STEPS):
            runner.step(batch(step, runner.worker, shift))
            if run == APART and step == 2:  # the plan completes at the third step
                runner.inter_machine_bytes()
        measured = runner.inter_machine_bytes()
        arch = config.architecture
        predicted = {p.name: p.predicted_bytes[arch] for p in runner.plan.parameters}
        alpha = {p.name: (p.alpha, p.alpha_machine) for p in runner.plan.parameters}
        sync = {p.name: p.sync for p in runner.plan.parameters}
        reason = {p.name: p.reason for p in runner.plan.parameters}
        states[run] = runner.state_dict()
        results[run] = {"measured": measured, "predicted": predicted, "alpha": alpha,
                        "sync": sync, "reason": reason,
                        "local_aggregation": runner.local_aggregation}
    # the placements move work, not what it computes (float32: sums in another order)
    results["placement_difference"] = {
        run: max(float((states[run][k] - states["ps"][k]).abs().max()
                       / states["ps"][k].abs().max()) for k in states["ps"])
        for run in ("ps-afterworkers", "ps-dedupservers")}
    results["trial"] = hop_trial()
    results["narrow"] = narrow_table(40_000)
    results["narrow_small"] = narrow_table(64)
    if runner.worker.rank == 0:
        with open(sys.argv[1], "w") as out:
            json.dump(results, out, indent=1)
    parallax.shutdown()


if __name__ == "__main__":
    main()
    exit_now()
