"""Analogs of the Slim-DP paper's Tables 1-2 and Figure 3: Plump-DP, Quant-DP and Slim-DP on a
dense CNN with many parameters for its compute (a small VGG-style net, ~0.5 M parameters, on
Fashion-MNIST), K workers on K emulated machines.

    python benchmarks/slim_dp.py --machines 4 8 --rates 1gbit 100mbit --steps 200
    python benchmarks/slim_dp.py --sweep --machines 4 --rates 100mbit     # alpha/beta sweep
    python benchmarks/slim_dp.py --ablation --vary-seeds --machines 4 8 --rates 1gbit \
        --steps 600 --eval-every 50                                       # the ablations
    python benchmarks/slim_dp.py --machines 2 --rates 1gbit --steps 4 --eval-every 2 \
        --repeats 1 --eval-size 200 --out-dir /tmp/smoke                  # smoke size

Modes (``--sweep``: Plump-DP and Slim-DP at several (alpha, beta); ``--ablation``: Plump-DP
and Slim-DP at q 20, q longer than the run, beta = 0, beta = alpha, and c = 0, 0.5, 4;
``--regime``: the paper's regime, Plump-DP, Quant-DP and Slim-DP with q longer than the run
at alpha 0.3 with beta 0, 0.15, 0.3 and at alpha 0.1, 0.2, 0.5 with beta alpha/2;
``--vary-seeds``: each repeat its own initial model and batches, for accuracy's spread):
``plump-ar`` Plump-DP by AllReduce (``dense_sync="hierarchical"``), ``plump`` Plump-DP through
servers, ``quant-ar`` Quant-DP by all-gathered QSGD codes (8 bits, buckets of 512),
``quant`` Quant-DP through servers (pushes quantised), ``slim`` Slim-DP (alpha 0.2, beta 0.1,
q 20, p 1). Each launch trains every mode in turn with the same seeds and batches (SGD,
momentum 0.9); ``--repeats`` launches rotate their order. Per mode: computation and
communication time per worker (communication: `Runner.dense_sync_seconds`, i.e. the hooks'
or the servers' rounds including encoding, decoding and selection, as the paper counts them;
computation: the rest of the step, and of it the finiteness check, the step's first
collective after the previous round, where a rank waits for the one whose round ended last),
the test accuracy every ``--eval-every`` steps on the
first ``--eval-size`` test images (evaluation time is not on the clock), Speed_d (Plump-DP's
training time over the mode's, same data) and Speed_a (Plump-DP's time to its final accuracy
over the mode's time to reach it), engine and wire bytes.

Writes ``<out-dir>/slim_dp[-sweep|-ablation].json`` (or ``--name``; every launch's raw records
and provenance), ``.md`` and ``.png`` (accuracy against training time, one panel per K and
rate). The network is emulated (tbf-limited veths, no delay) and every worker shares this host's
cores: with K above the core count, computation is K-fold contended. Needs root and iproute2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))

import records  # noqa: E402
from compare import provenance  # noqa: E402

MODES = [
    {"label": "plump-ar", "dense_sync": "hierarchical"},
    {"label": "plump", "dense_sync": "plump"},
    {"label": "quant-ar", "dense_sync": "qsgd", "qsgd": {"bits": 8, "bucket_size": 512}},
    {"label": "quant", "dense_sync": "plump", "qsgd": {"bits": 8, "bucket_size": 512}},
    {"label": "slim", "dense_sync": "slim",
     "slim": {"alpha": 0.2, "beta": 0.1, "reselect_every": 20, "sync_every": 1}},
]
SWEEP = [(0.1, 0.05), (0.2, 0.1), (0.3, 0.15), (0.5, 0.25), (0.2, 0.2)]
SIGNIFICANCES = (0.0, 0.5, 4.0)  # the ablation's c besides the default 1
BASELINE = "plump"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--machines", type=int, nargs="+", default=[4, 8],
                        help="K values: one worker per emulated machine")
    parser.add_argument("--rates", nargs="+", default=["1gbit", "100mbit"])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--width", type=int, default=256, help="fully connected width")
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--eval-size", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", nargs="+", metavar="LABEL",
                        help="only these modes (labels as in the tables; default: all)")
    parser.add_argument("--ablation", action="store_true",
                        help="Plump-DP and Slim-DP's ablations instead: q 20, q longer than the "
                        "run (the paper's regime), beta = 0 (no core), beta = alpha (no "
                        "explorer), and c in 0, 0.5, 4")
    parser.add_argument("--regime", action="store_true",
                        help="the paper's regime instead (issue 74 item 5): Plump-DP, Quant-DP "
                        "and Slim-DP with q longer than the run, beta in 0, alpha/2, alpha at "
                        "alpha 0.3, and alpha 0.1, 0.2, 0.5 at beta alpha/2 (run at the rate "
                        "where Plump-DP's communication share is the paper's: bench.sh "
                        "slim-share)")
    parser.add_argument("--first-seed", type=int, default=0,
                        help="with --vary-seeds: repeat r draws seed first-seed + r (a run's "
                        "seeds split over sittings)")
    parser.add_argument("--vary-seeds", action="store_true",
                        help="repeat r draws its initial model and batches from seed r "
                        "(default: every repeat the same, so only the times vary)")
    parser.add_argument("--sweep", action="store_true",
                        help="Plump-DP and Slim-DP at several (alpha, beta) instead")
    parser.add_argument("--out-dir", type=Path, default=records.scratch())
    parser.add_argument("--name", help="the records' name (default: slim_dp, slim_dp-sweep "
                        "or slim_dp-ablation)")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--from-json", type=Path, metavar="FILE",
                        help="rebuild the tables and figure from the raw records of an "
                             "earlier run's JSON (no training; its options and provenance)")
    return parser.parse_args(argv)


def _slim(label: str, alpha: float = 0.2, beta: float = 0.1, q: int = 20,
          c: float = 1.0) -> dict[str, Any]:
    return {"label": label, "dense_sync": "slim",
            "slim": {"alpha": alpha, "beta": beta, "reselect_every": q, "sync_every": 1,
                     "significance": c}}


def modes_of(args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.sweep:
        modes = [MODES[1]] + [_slim(f"slim a={a} b={b}", a, b) for a, b in SWEEP]
    elif getattr(args, "regime", False):
        beyond = args.steps + 1  # the paper's q (20k-50k mini-batches): longer than the run
        modes = [MODES[1], MODES[3]] + [
            _slim(f"slim a=0.3 b={b:g}", 0.3, b, q=beyond) for b in (0.0, 0.15, 0.3)] + [
            _slim(f"slim a={a:g} b={a / 2:g}", a, a / 2, q=beyond) for a in (0.1, 0.2, 0.5)]
    elif getattr(args, "ablation", False):
        beyond = args.steps + 1  # no full round and no re-selection within the run
        modes = [MODES[1], _slim("slim"), _slim("slim q>run", q=beyond),
                 _slim("slim b=0", beta=0.0), _slim("slim b=a", beta=0.2)] + [
            _slim(f"slim c={c:g}", c=c) for c in SIGNIFICANCES]
    else:
        modes = MODES
    if not getattr(args, "modes", None):
        return modes
    unknown = sorted(set(args.modes) - {m["label"] for m in modes})
    if unknown:
        raise SystemExit(f"slim_dp: unknown mode(s) {unknown}; the modes: "
                         f"{[m['label'] for m in modes]}")
    return [m for m in modes if m["label"] in args.modes]


def launch(args: argparse.Namespace, machines: int, rate: str, repeat: int,
           out: Path) -> list[dict[str, Any]]:
    worker_args = {"modes": modes_of(args), "steps": args.steps, "batch": args.batch,
                   "lr": args.lr, "width": args.width, "eval_every": args.eval_every,
                   "eval_size": args.eval_size, "order_shift": repeat, "out": str(out),
                   "seed": (getattr(args, "first_seed", 0) + repeat
                            if getattr(args, "vary_seeds", False) else 0)}
    cmd = [sys.executable, "-m", "parallax.cli", "run", "--machines", str(machines),
           "--nproc-per-machine", "1", "--emulate-network", rate,
           str(HERE / "slim_dp_worker.py"), json.dumps(worker_args)]
    out.unlink(missing_ok=True)
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())


def summarise(records: list[list[dict[str, Any]]], steps: int) -> dict[str, dict[str, Any]]:
    """Per mode, over repeats: medians of training time, communication and computation per
    worker, final accuracy, bytes; the median repeat's accuracy curve."""
    out: dict[str, dict[str, Any]] = {}
    labels = [r["label"] for r in records[0]]
    for label in labels:
        runs = [next(r for r in repeat if r["label"] == label) for repeat in records]
        totals, comms, choosing, waits = [], [], [], []
        for run in runs:
            ranks = run["ranks"]
            per_step = [statistics.fmean(r["step_s"][i] for r in ranks) for i in range(steps)]
            totals.append(sum(per_step))
            comms.append(statistics.fmean(sum(r["sync_s"]) for r in ranks))
            choosing.append(statistics.fmean(r.get("choosing_s", 0.0) for r in ranks))
            waits.append(_check_seconds(ranks, steps))
        median_run = runs[sorted(range(len(runs)), key=lambda i: totals[i])[len(runs) // 2]]
        stats = median_run["ranks"][0]["stats"]
        dense_bytes = sum(v for name, counts in stats.items() if name != "step phases"
                          for v in counts.values())
        out[label] = {
            "train_s": statistics.median(totals), "train_s_all": totals,
            "comm_s": statistics.median(comms),
            # of comm_s: Slim-DP's explorer draws and core selections (not overlapped with
            # computation: they run in the round after the step)
            "choosing_s": statistics.median(choosing),
            "comp_s": statistics.median(t - c for t, c in zip(totals, comms, strict=True)),
            # of comp_s: the step's finiteness check, the first collective after the round:
            # mostly waiting for the rank whose round ended last (None: records without phases)
            "check_s": (statistics.median([w for w in waits if w is not None])
                        if None not in waits else None),
            "final_accuracy": median_run["curve"][-1]["accuracy"],
            # less noisy than one evaluation: the mean of the last three
            "late_accuracy": statistics.fmean(p["accuracy"] for p in median_run["curve"][-3:]),
            "curve": median_run["curve"],
            # every repeat's (they differ only with --vary-seeds)
            "late_accuracy_runs": [statistics.fmean(p["accuracy"] for p in run["curve"][-3:])
                                   for run in runs],
            "engine_bytes_per_step_rank0": dense_bytes,
            "wire_bytes_per_step_machine": statistics.fmean(
                r["wire"] for r in median_run["ranks"]) / steps,
            "params": median_run["params"]}
    base = out.get(BASELINE)
    for row in out.values():
        if base is None:
            continue
        row["speed_d"] = base["train_s"] / row["train_s"]
        target = base["final_accuracy"]
        reached = next((p["seconds"] for p in row["curve"] if p["accuracy"] >= target), None)
        base_reached = next(p["seconds"] for p in base["curve"] if p["accuracy"] >= target)
        row["speed_a"] = base_reached / reached if reached else None
    return out


def _check_seconds(ranks: list[dict[str, Any]], steps: int) -> float | None:
    """Mean over ranks of the run's seconds in the "clip and check" phase (None when the
    records hold no phases: runs before the runner kept them)."""
    phases = [r["stats"].get("step phases") for r in ranks]
    if any(p is None or "clip and check" not in p for p in phases):
        return None
    return statistics.fmean(p["clip and check"] for p in phases) * steps


def markdown(summary: dict[str, dict[str, dict[str, Any]]], args: argparse.Namespace) -> str:
    per = 1000 / args.steps
    lines = [f"{args.steps} steps x {args.batch} images per worker, SmallVGG width "
             f"{args.width}, SGD lr {args.lr} momentum 0.9; accuracy on the first "
             f"{args.eval_size} test images; medians over {args.repeats} repeats; times per "
             f"worker scaled to 1,000 mini-batches; speeds normalised to `{BASELINE}` "
             f"(Plump-DP through servers). Emulated network.", ""]
    for key, rows in summary.items():
        lines += [f"### {key}", "",
                  "| mode | comp s/1k | of which check | comm s/1k | of which choosing "
                  "| total s/1k | accuracy | last 3 evals | last 3, every repeat: mean (min-max) "
                  "| Speed_d | Speed_a | dense bytes/step (rank 0, engine) "
                  "| wire bytes/step/machine |",
                  "|---" * 13 + "|"]
        for label, row in rows.items():
            speed_a = f"{row['speed_a']:.2f}" if row.get("speed_a") else "not reached"
            check = row.get("check_s")
            lines.append(
                f"| {label} | {row['comp_s'] * per:.1f} | "
                f"{'–' if check is None else f'{check * per:.1f}'} | {row['comm_s'] * per:.1f} | "
                f"{row['choosing_s'] * per:.2f} | {row['train_s'] * per:.1f} | "
                f"{row['final_accuracy']:.4f} | {row['late_accuracy']:.4f} | "
                f"{_spread(row.get('late_accuracy_runs', [row['late_accuracy']]))} | "
                f"{row.get('speed_d', float('nan')):.2f} | {speed_a} | "
                f"{row['engine_bytes_per_step_rank0']:,.0f} | "
                f"{row['wire_bytes_per_step_machine']:,.0f} |")
        lines.append("")
    return "\n".join(lines)


def _spread(values: list[float]) -> str:
    return f"{statistics.fmean(values):.4f} ({min(values):.4f}-{max(values):.4f})"


def plot(summary: dict[str, dict[str, dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(summary)
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        for label, row in summary[key].items():
            ax.plot([p["seconds"] for p in row["curve"]], [p["accuracy"] for p in row["curve"]],
                    marker="o", markersize=3, label=label)
        ax.set_title(f"{key} (emulated)")
        ax.set_xlabel("training time (s)")
        ax.set_ylabel("test accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json is not None:
        return rebuild(args.from_json, args)
    from corpora import fetch

    fetch("fashion-mnist")  # workers behind the emulated network cannot download
    args.out_dir.mkdir(parents=True, exist_ok=True)
    name = args.name or ("slim_dp-sweep" if args.sweep else "slim_dp-ablation"
                         if args.ablation else "slim_dp-regime" if args.regime else "slim_dp")
    raw: dict[str, list[list[dict[str, Any]]]] = {}
    for machines in args.machines:
        for rate in args.rates:
            key = f"K={machines}, {rate}"
            for repeat in range(args.repeats):
                print(f"slim_dp: {key}, repeat {repeat + 1}/{args.repeats}", file=sys.stderr,
                      flush=True)
                out = args.out_dir / f"{name}-launch.json"
                raw.setdefault(key, []).append(launch(args, machines, rate, repeat, out))
                out.unlink(missing_ok=True)
    report = {"experiment": name, "options": {k: str(v) if isinstance(v, Path) else v
                                              for k, v in vars(args).items()},
              "provenance": provenance(), "raw": raw}
    write(report, args.out_dir, args)
    return 0


def rebuild(path: Path, args: argparse.Namespace) -> int:
    """The outputs again from a JSON's raw records (e.g. after the summary gained a field),
    written beside it; options and provenance stay those of the run that made them."""
    report = json.loads(path.read_text())
    options = argparse.Namespace(**{**vars(args), **report["options"]})
    options.no_plot = args.no_plot
    write(report, path.parent, options, name=path.stem)
    return 0


def write(report: dict[str, Any], out_dir: Path, args: argparse.Namespace,
          name: str | None = None) -> None:
    """``<name>.json`` (default: the experiment's name) with the summary, ``.md``, ``.png``."""
    name = name or report["experiment"]
    summary = {key: summarise(records, args.steps) for key, records in report["raw"].items()}
    report = {**report, "summary": summary}
    (out_dir / f"{name}.json").write_text(json.dumps(report, indent=1))
    text = markdown(summary, args)
    (out_dir / f"{name}.md").write_text(text + "\n")
    print(text)
    if not args.no_plot:
        plot(summary, out_dir / f"{name}.png")


if __name__ == "__main__":
    sys.exit(main())
