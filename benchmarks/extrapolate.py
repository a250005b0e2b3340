"""The cost model past this host (issue 18 item 6): step time, bytes and throughput of
hybrid, ps and allreduce on the LM at 16, 64 and 256 machines, with 1 and 8 workers per
machine, from the measured 1–8 machine scaling runs (``scaling.py``'s record).

    python benchmarks/extrapolate.py       # reads the newest scaling record
    python benchmarks/extrapolate.py --scaling FILE --machines 16 64 256 --workers 1 8

Model of one step of system ``s`` on ``N`` machines with ``k`` workers each (``W = N k``):

    t = c_s · g(W) + β · B_s(N, k) + λ_s · (W − 1)

- ``B_s``: the Table-3 bytes per machine and step (`parallax.planning`), each table's rows per
  worker (U) and per machine (U_m, the union of a machine's k workers) counted on the
  workload's own batches (the harness's generators), the hybrid's local-aggregation rule
  (`MIN_AGGREGATION_SAVING`) and AllReduce rule applied as the engine applies them;
- ``c_s``: the computation of a step; ``g(W) = max(1, W / cores)``: on this host every
  emulated machine shares its ``cores`` cores, so the measured points pay ``g``; on a real
  cluster every worker has its own core, ``g = 1``;
- ``β``: seconds per byte on the link (shared by the systems; nominal for tc's rate r:
  sent + received share one full-duplex link, so ``1 / (2 r)`` when both directions overlap
  perfectly, ``1 / r`` when they do not);
- ``λ_s``: a per-peer cost of each step's collectives (all_to_all and ring steps grow with
  the world). On this host it also absorbs what every added process costs the others beyond
  ``g`` (gloo's threads, the servers' work for more peers, all on the same two cores), so the
  predictions are given twice: with the fitted ``λ_s`` (pessimistic: this host's contention
  counted as network latency) and without the term (compute + link bytes only: optimistic).

``c_s, β, λ_s`` are fitted by non-negative least squares (scipy's ``nnls``). Two fits: one on
the 1, 2 and 4 machine points that is checked against the measured 8-machine point (the
validation error), and one on all measured points that makes the predictions. What is not
modelled, and so is an assumption: intra-machine traffic is free (shared memory), the
servers' update time is part of ``c_s`` (it does not grow with N: each server's rows shrink as
1/N while the rows pushed to it stay constant per machine), and λ_s measured with processes
sharing two cores may overstate a real network's per-peer latency.

Writes ``benchmarks/out/extrapolation.json``, ``.md`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy.optimize import nnls

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import records  # noqa: E402
from workloads import LMConfig, SampledSoftmaxLM, zipf_lm_batch  # noqa: E402

from parallax.config import ArchitectureName  # noqa: E402
from parallax.planning import cost  # noqa: E402
from parallax.planning.architectures import (  # noqa: E402
    ARCHITECTURES,
    MIN_AGGREGATION_SAVING,
    ParameterCost,
)

SYSTEMS = ("hybrid", "ps", "allreduce")
SPARSE = ("embedding.weight", "softmax.weight")  # the LM's tables, read by lookups


@dataclass(frozen=True)
class Point:
    """One measured (or predicted) step: system, cluster shape, seconds, bytes."""

    system: str
    machines: int
    workers: int  # per machine
    step_s: float
    wire_bytes: float | None = None

    @property
    def world(self) -> int:
        return self.machines * self.workers


# ---- bytes: Table 3 for the LM ----------------------------------------------------------------
def rows_used(cfg: LMConfig, workers: int, steps: int = 20) -> dict[str, tuple[float, float]]:
    """``{table: (U, U_m)}``: rows one worker and one machine of ``workers`` workers read per
    step, averaged over ``steps`` steps of the harness's batches (rank r's generator seeded
    ``1000 + r``, as compare_worker draws them)."""
    generators = [torch.Generator().manual_seed(1000 + r) for r in range(workers)]
    per_worker = {t: 0.0 for t in SPARSE}
    per_machine = {t: 0.0 for t in SPARSE}
    for _ in range(steps):
        ids: dict[str, list[torch.Tensor]] = {t: [] for t in SPARSE}
        for generator in generators:
            (tokens, candidates), _ = zipf_lm_batch(cfg, generator)
            ids["embedding.weight"].append(tokens.reshape(-1).unique())
            ids["softmax.weight"].append(candidates.unique())
        for table, lists in ids.items():
            per_worker[table] += sum(i.numel() for i in lists) / workers / steps
            per_machine[table] += torch.cat(lists).unique().numel() / steps
    return {t: (per_worker[t], per_machine[t]) for t in SPARSE}


def parameter_costs(cfg: LMConfig, used: dict[str, tuple[float, float]],
                    ) -> dict[str, ParameterCost]:
    """The LM's parameters as the byte model sees them (shapes from a meta-device model)."""
    with torch.device("meta"):
        model = SampledSoftmaxLM(cfg)
    costs = {}
    for name, param in model.named_parameters():
        rows = param.shape[0] if param.dim() else 1
        row_bytes = param.numel() * param.element_size() / rows
        u, u_m = used.get(name, (None, None))
        costs[name] = ParameterCost(rows=rows, row_bytes=row_bytes, sparse=name in used,
                                    used=u, used_machine=u_m,
                                    sync="ps" if name in used else "allreduce")
    return costs


def hybrid_settings(costs: dict[str, ParameterCost], shape: cost.Shape,
                    ) -> tuple[dict[str, ParameterCost], bool]:
    """The hybrid's two decisions at ``shape``, as `parallax.planning.architectures.Hybrid`
    takes them: a table moves to AllReduce where that is predicted to cost fewer bytes than
    the PS; the leader hop stays where merging saves >= MIN_AGGREGATION_SAVING of the bytes."""
    aggregating = shape.workers_per_machine > 1
    merged = separate = 0.0
    settled = {}
    for name, p in costs.items():
        if p.sparse:
            ps = cost.ps_rows(p.used_machine if aggregating else p.used, p.row_bytes, shape,
                              local_aggregation=aggregating)
            if cost.allreduce_dense(p.total, shape) < ps:
                p = ParameterCost(p.rows, p.row_bytes, True, p.used, p.used_machine,
                                  "allreduce")
            else:
                merged += cost.ps_rows(p.used_machine, p.row_bytes, shape,
                                       local_aggregation=True)
                separate += cost.ps_rows(p.used, p.row_bytes, shape, local_aggregation=False)
        settled[name] = p
    keep = aggregating and separate > 0 and 1 - merged / separate >= MIN_AGGREGATION_SAVING
    return settled, keep


def predicted_bytes(system: str, costs: dict[str, ParameterCost], shape: cost.Shape) -> float:
    """Inter-machine bytes per machine and step of ``system`` (hybrid, ps, allreduce)."""
    architecture = ARCHITECTURES[ArchitectureName(system)]
    local_aggregation = None
    if system == "hybrid":
        costs, local_aggregation = hybrid_settings(costs, shape)
    total = 0.0
    for p in costs.values():
        value = architecture.predicted_bytes(p, shape, local_aggregation=local_aggregation)
        assert value is not None, "every sparse table has its rows counted"
        total += value
    return total


# ---- time: fit and predict --------------------------------------------------------------------
def compute_share(world: int, cores: int | None) -> float:
    """g(W): how many processes share a core (None: a real cluster, one core each)."""
    return 1.0 if cores is None else max(1.0, world / cores)


def design_row(system: str, world: int, bytes_: float, cores: int | None) -> list[float]:
    """Columns: c_s for each system, β, λ_s for each system."""
    row = [0.0] * (2 * len(SYSTEMS) + 1)
    s = SYSTEMS.index(system)
    row[s] = compute_share(world, cores)
    row[len(SYSTEMS)] = bytes_
    row[len(SYSTEMS) + 1 + s] = world - 1
    return row


@dataclass(frozen=True)
class Fit:
    compute_s: dict[str, float]
    seconds_per_byte: float
    per_peer_s: dict[str, float]

    def step_s(self, system: str, world: int, bytes_: float, cores: int | None) -> float:
        return (self.compute_s[system] * compute_share(world, cores)
                + self.seconds_per_byte * bytes_ + self.per_peer_s[system] * (world - 1))

    def as_dict(self) -> dict[str, Any]:
        return {"compute_s": self.compute_s, "seconds_per_byte": self.seconds_per_byte,
                "per_peer_s": self.per_peer_s}


def fit(points: list[Point], bytes_of: dict[tuple[str, int, int], float], cores: int) -> Fit:
    """``c_s, β, λ_s`` by non-negative least squares on relative errors (every point weighs
    alike, whether its step takes 40 ms or 4 s)."""
    rows = np.array([design_row(p.system, p.world, bytes_of[p.system, p.machines, p.workers],
                                cores) for p in points])
    times = np.array([p.step_s for p in points])
    x, _ = nnls(rows / times[:, None], np.ones(len(points)))
    n = len(SYSTEMS)
    return Fit(dict(zip(SYSTEMS, x[:n].tolist(), strict=True)), float(x[n]),
               dict(zip(SYSTEMS, x[n + 1:].tolist(), strict=True)))


# ---- the measured record ----------------------------------------------------------------------
def load_points(path: Path) -> tuple[list[Point], dict[str, Any]]:
    """The scaling record's hybrid/ps/allreduce points and the LM settings they ran with."""
    record = records.read(path)
    points, settings = [], None
    for run in record["runs"]:
        for result in run.get("results", []):
            if result.get("system") in SYSTEMS and "unavailable" not in result:
                points.append(Point(result["system"], run["settings"]["machines"],
                                    run["settings"]["nproc_per_machine"],
                                    result["median_step_s"],
                                    result.get("wire_bytes_per_machine_step")))
                settings = settings or run["settings"]
    if settings is None:
        raise SystemExit(f"extrapolate: {path} holds no hybrid, ps or allreduce result; run "
                         f"benchmarks/scaling.py --systems hybrid ps allreduce first")
    return points, {"record": record, "settings": settings}


def lm_config(settings: dict[str, Any]) -> LMConfig:
    base = LMConfig()
    return LMConfig(vocab=settings.get("vocab") or base.vocab,
                    emb=settings.get("emb") or base.emb,
                    hidden=settings.get("hidden") or base.hidden,
                    seq_len=settings.get("seq_len") or base.seq_len,
                    batch=settings.get("batch") or base.batch)


def analyse(points: list[Point], cfg: LMConfig, cores: int, machines: list[int],
            workers: list[int]) -> dict[str, Any]:
    """Bytes for every shape, both fits, the validation errors and the predictions."""
    shapes = {(p.machines, p.workers) for p in points}
    shapes |= {(m, k) for m in machines for k in workers}
    used = {k: rows_used(cfg, k) for k in {k for _, k in shapes}}
    bytes_of = {(s, m, k): predicted_bytes(s, parameter_costs(cfg, used[k]), cost.Shape(m, k))
                for s in SYSTEMS for m, k in shapes}
    largest = max(p.machines for p in points)
    training = [p for p in points if p.machines < largest]
    validation = fit(training, bytes_of, cores)
    final = fit(points, bytes_of, cores)
    measured = []
    for p in sorted(points, key=lambda p: (p.system, p.machines)):
        model_bytes = bytes_of[p.system, p.machines, p.workers]
        held_out = validation.step_s(p.system, p.world, model_bytes, cores)
        in_sample = final.step_s(p.system, p.world, model_bytes, cores)
        measured.append({
            "system": p.system, "machines": p.machines, "workers": p.workers,
            "step_s": p.step_s, "wire_bytes": p.wire_bytes, "model_bytes": model_bytes,
            "wire_over_model": p.wire_bytes / model_bytes if p.wire_bytes and model_bytes
            else None,
            "validation_fit_s": held_out, "validation_error": held_out / p.step_s - 1,
            "held_out": p.machines == largest,
            "final_fit_s": in_sample, "final_error": in_sample / p.step_s - 1})
    items = cfg.batch * cfg.seq_len  # words per worker and step
    predictions = []
    for m in machines:
        for k in workers:
            row: dict[str, Any] = {"machines": m, "workers": k}
            for s in SYSTEMS:
                step = final.step_s(s, m * k, bytes_of[s, m, k], None)
                # the λ term fitted here is mostly this host's contention (see the docstring):
                # the bound without it is compute + link bytes
                bound = step - final.per_peer_s[s] * (m * k - 1)
                row[s] = {"step_s": step, "bytes": bytes_of[s, m, k],
                          "words_per_s": m * k * items / step,
                          "step_s_without_peers": bound,
                          "words_per_s_without_peers": m * k * items / bound,
                          "compute_share": final.compute_s[s] / step}
            for other in ("ps", "allreduce"):
                row[f"hybrid_vs_{other}"] = row[other]["step_s"] / row["hybrid"]["step_s"]
                row[f"hybrid_vs_{other}_without_peers"] = (
                    row[other]["step_s_without_peers"] / row["hybrid"]["step_s_without_peers"])
            predictions.append(row)
    return {"cores": cores, "lm": vars(cfg), "rows_used": {str(k): v for k, v in used.items()},
            "validation_fit": {**validation.as_dict(),
                               "fitted_on_machines": sorted({p.machines for p in training})},
            "final_fit": final.as_dict(), "measured": measured, "predictions": predictions}


def markdown(result: dict[str, Any], source: str) -> str:
    fit_v, fit_f = result["validation_fit"], result["final_fit"]
    lines = [f"Cost-model extrapolation of {source} (LM: vocab {result['lm']['vocab']:,}, "
             f"batch {result['lm']['batch']}/worker); measured points share {result['cores']} "
             f"cores.", "",
             "Measured against the model (validation fit on "
             f"{fit_v['fitted_on_machines']} machines; the largest cluster is held out):", "",
             "| system | machines | step (ms) | validation fit (ms) | error | final fit (ms) "
             "| error | wire bytes | model bytes | wire/model |", "|---" * 10 + "|"]
    for r in result["measured"]:
        lines.append(
            f"| {r['system']} | {r['machines']}{' (held out)' if r['held_out'] else ''} | "
            f"{r['step_s'] * 1e3:,.0f} | {r['validation_fit_s'] * 1e3:,.0f} | "
            f"{r['validation_error']:+.0%} | {r['final_fit_s'] * 1e3:,.0f} | "
            f"{r['final_error']:+.0%} | {_num(r['wire_bytes'])} | {_num(r['model_bytes'])} | "
            f"{_num(r['wire_over_model'], '.2f')} |")
    lines += ["", "Fitted (all points): " + ", ".join(
        f"c_{s} {fit_f['compute_s'][s] * 1e3:.1f} ms, λ_{s} {fit_f['per_peer_s'][s] * 1e3:.2f} "
        f"ms/peer" for s in SYSTEMS) + f"; β {fit_f['seconds_per_byte'] * 1e9:.2f} ns/B "
        f"(1 Gbit/s: 8 ns/B one way, 4 ns/B for sent + received overlapped)", "",
        "Predicted, every worker with its own core (g = 1); each step time with the fitted "
        "per-peer term, then without it (compute + link bytes only):", "",
        "| machines | workers/machine | hybrid step (ms) | ps | allreduce | hybrid words/s "
        "| hybrid vs ps | hybrid vs allreduce | hybrid bytes/machine | ps | allreduce |",
        "|---" * 11 + "|"]
    for r in result["predictions"]:
        h, p_, a = r["hybrid"], r["ps"], r["allreduce"]
        lines.append(
            f"| {r['machines']} | {r['workers']} | {_ms(h)} | {_ms(p_)} | {_ms(a)} | "
            f"{h['words_per_s']:,.0f} / {h['words_per_s_without_peers']:,.0f} | "
            f"{r['hybrid_vs_ps']:.2f}x / {r['hybrid_vs_ps_without_peers']:.2f}x | "
            f"{r['hybrid_vs_allreduce']:.2f}x / {r['hybrid_vs_allreduce_without_peers']:.2f}x | "
            f"{_num(h['bytes'])} | {_num(p_['bytes'])} | {_num(a['bytes'])} |")
    return "\n".join(lines)


def _ms(prediction: dict[str, float]) -> str:
    return (f"{prediction['step_s'] * 1e3:,.0f} / "
            f"{prediction['step_s_without_peers'] * 1e3:,.0f}")


def _num(value: float | None, spec: str = ",.0f") -> str:
    return "–" if value is None else format(value, spec)


def plot(result: dict[str, Any], path: Path) -> None:
    import experiment

    plt = experiment.pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for system, colour in zip(SYSTEMS, ("C0", "C1", "C2"), strict=True):
        rows = [r for r in result["measured"] if r["system"] == system]
        left.plot([r["machines"] for r in rows], [r["step_s"] * 1e3 for r in rows], "o",
                  color=colour, label=f"{system} measured")
        left.plot([r["machines"] for r in rows], [r["final_fit_s"] * 1e3 for r in rows], "--",
                  color=colour, label=f"{system} model")
        rows = [r for r in result["predictions"] if r["workers"] == max(
            p["workers"] for p in result["predictions"])]
        k = rows[0]["workers"] if rows else 0
        for key, style, what in (("words_per_s", "-", "fitted"),
                                 ("words_per_s_without_peers", ":", "no per-peer term")):
            right.plot([r["machines"] for r in rows], [r[system][key] for r in rows],
                       marker="o", color=colour, linestyle=style,
                       label=f"{system}, {k} workers/machine, {what}")
    left.set(xscale="log", yscale="log", xlabel="machines (1 worker each, this host)",
             ylabel="step (ms)", title="measured vs fitted model")
    left.set_xscale("log", base=2)
    right.set(yscale="log", xlabel="machines", ylabel="words/s (predicted)",
              title="predicted, one core per worker")
    machines = sorted({r["machines"] for r in result["predictions"]})
    right.set_xscale("log", base=2)
    right.set_xticks(machines, [str(m) for m in machines])
    right.minorticks_off()
    right.legend(fontsize=7)
    experiment.save_figure(fig, left, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scaling", type=Path, help="the scaling record (default: the "
                        "newest record of the experiment scaling)")
    parser.add_argument("--machines", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 8],
                        help="workers per machine in the predictions")
    parser.add_argument("--cores", type=int, help="cores the measured machines shared "
                        "(default: the record's host)")
    parser.add_argument("--out", type=Path, default=records.scratch() / "extrapolation.json")
    args = parser.parse_args(argv)
    if args.scaling is None:
        args.scaling = records.newest("scaling")
    if not args.scaling.exists():
        parser.error(f"--scaling {args.scaling} does not exist (bash scripts/bench.sh scaling)")
    points, source = load_points(args.scaling)
    if len({p.machines for p in points}) < 3:
        parser.error(f"--scaling {args.scaling}: need points on >= 3 machine counts (one is "
                     f"held out), got {sorted({p.machines for p in points})}")
    cores = args.cores or _record_cores(source["record"]) or os.cpu_count() or 1
    result = analyse(points, lm_config(source["settings"]), cores, args.machines, args.workers)
    result["source"] = str(args.scaling)
    result["source_commits"] = sorted({r.get("provenance", {}).get("commit") or "?"
                                       for run in source["record"]["runs"]
                                       for r in run.get("results", [])})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    text = markdown(result, args.scaling.name)
    args.out.with_suffix(".md").write_text(text + "\n")
    plot(result, args.out.with_suffix(".png"))
    print(text)
    return 0


def _record_cores(record: dict[str, Any]) -> int | None:
    for run in record["runs"]:
        for r in run.get("results", []):
            cores = r.get("provenance", {}).get("host", {}).get("cores")
            if cores:
                return int(cores)
    return None


if __name__ == "__main__":
    sys.exit(main())
