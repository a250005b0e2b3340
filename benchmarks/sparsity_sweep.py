"""Sparsity sweep (Table 6 analog): the LM at several sequence lengths, so that α_model spans
~0.04 to 1, under the hybrid, the PS and AllReduce.

    python benchmarks/sparsity_sweep.py --rate 1gbit
    python benchmarks/sparsity_sweep.py --points 2000:5 200:40 --systems hybrid ps \
        --machines 2 --nproc-per-machine 1 --steps 2 --warmup 1     # smoke size

A point is VOCAB:SEQ_LEN[:BATCH]. More words per worker batch touch more rows; the LSTM (dense,
α = 1) weighs more against a small vocabulary. With 16 x SEQ_LEN Zipf words per worker and 512
sampled classes, one vocabulary cannot span the range within sequences the sampled softmax can
hold (its logits are words x (words + 512)), so the defaults also shrink the vocabulary towards
the dense end: 30000:60 (α_model ≈ 0.04), 10000:40, 10000:160, 3000:160, 1000:320, 300:320
(≈ 1.0). The α_model *measured* by the parallax systems over the warm-up steps is what is
reported and plotted. Writes benchmarks/out/sparsity.json, .md and .png (words/s against
α_model, one line per system). Needs root and iproute2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import compare
import experiment
from experiment import alpha_model, by_system, cell, with_ratio

DEFAULT_POINTS = ["30000:60", "10000:40", "10000:160", "3000:160", "1000:320", "300:320"]
#: the paper's Table 6 (`000`/`003`, Parallax EuroSys'19), by sequence length: its α_model and
#: Parallax's speed-up over TF-PS, shown beside the point of the same length
PAPER_TABLE6 = {120: (1.0, 2.04), 60: (0.52, 2.33), 30: (0.28, 2.43), 15: (0.16, 2.89),
                8: (0.1, 3.02), 4: (0.07, 3.03), 1: (0.04, 3.42)}


def point(text: str) -> tuple[int, int, int | None]:
    """``VOCAB:SEQ_LEN[:BATCH]`` -> (vocab, seq_len, batch or None)."""
    try:
        values = [int(v) for v in text.split(":")]
        if len(values) not in (2, 3) or min(values) < 1:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not VOCAB:SEQ_LEN[:BATCH] (positive integers)") from None
    return values[0], values[1], values[2] if len(values) == 3 else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", nargs="+", type=point,
                        default=[point(p) for p in DEFAULT_POINTS], metavar="VOCAB:SEQ_LEN")
    parser.add_argument("--systems", nargs="+", choices=compare.ALL_SYSTEMS,
                        default=["hybrid", "ps", "allreduce"], help="the first is the base")
    parser.add_argument("--name", default="sparsity", help="output file stem")
    experiment.add_common_arguments(parser, lm_shape=False)
    return parser.parse_args(argv)


def rows(exp: experiment.Experiment) -> list[dict]:
    """Per point: its shape, the α_model reached, and each system's throughput."""
    result = []
    for run in exp.runs:
        settings = run["settings"]
        got = by_system(run.get("results", []))
        result.append({"label": run["label"], "vocab": settings["vocab"],
                       "seq_len": settings["seq_len"], "batch": settings["batch"],
                       "alpha_model": alpha_model(run.get("results", [])),
                       "alphas": next((r.get("alphas") for r in run.get("results", [])
                                       if r.get("alphas")), None),
                       "items_per_s": {s: r["items_per_s"] for s, r in got.items()},
                       "failed": "error" in run})
    return result


def summary(exp: experiment.Experiment) -> str:
    args = exp.args
    base = args.systems[0]
    head = ["vocab", "seq_len", "batch", "α_model (measured)", "tables' α",
            *(f"{s} words/s (vs {base})" for s in args.systems), "hybrid moved to AllReduce",
            "the paper at this length: α_model, Parallax over TF-PS"]
    reached = [r["alpha_model"] for r in rows(exp) if r["alpha_model"] is not None]
    span = f"{min(reached):.3f}–{max(reached):.3f}" if reached else "not measured"
    lines = [f"Sparsity sweep (LM): {args.machines} machines x {args.nproc_per_machine} "
             f"workers, {args.rate} (emulated), {args.warmup} warm-up + {args.steps} timed "
             f"steps; α_model reached {span}", "",
             "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for run, row in zip(exp.runs, rows(exp), strict=True):
        if row["failed"]:
            lines.append(f"| {row['vocab']} | {row['seq_len']} | failed |"
                         + " |" * (len(head) - 3))
            continue
        rate = row["items_per_s"]
        moved = by_system(run["results"]).get("hybrid", {}).get("synced_by")
        moved_text = ("–" if moved is None else
                      ", ".join(n for n, sync in moved.items() if sync != "ps") or "none")
        paper = PAPER_TABLE6.get(row["seq_len"])
        tables = ", ".join(f"{name} {alpha:.3f}" for name, alpha in (row["alphas"] or {}).items())
        lines.append("| " + " | ".join([
            str(row["vocab"]), str(row["seq_len"]), str(row["batch"]),
            cell(row["alpha_model"], ".3f"), tables or "–",
            *(with_ratio(rate.get(s), rate.get(base)) for s in args.systems),
            moved_text, f"{paper[0]:g}, {paper[1]:.2f}x" if paper else "–"]) + " |")
    return "\n".join(lines)


def plot(exp: experiment.Experiment, path: Path) -> None:
    plt = experiment.pyplot()
    from matplotlib.ticker import FuncFormatter

    fig, ax = plt.subplots(figsize=(6, 3.8))
    points = [r for r in rows(exp) if r["alpha_model"] is not None]
    for system in exp.args.systems:
        xy = sorted((r["alpha_model"], r["items_per_s"][system]) for r in points
                    if system in r["items_per_s"])
        ax.plot([x for x, _ in xy], [y for _, y in xy], marker="o", label=system)
    ax.set_xscale("log")
    for axis in (ax.xaxis.set_major_formatter, ax.xaxis.set_minor_formatter):
        axis(FuncFormatter(lambda value, _: f"{value:g}"))  # 0.04, not 4 x 10^-2
    ax.set_xlabel("α_model (measured)")
    ax.set_ylabel("words/s")
    ax.set_title(f"LM, {exp.args.machines}x{exp.args.nproc_per_machine}, {exp.args.rate} "
                 "(emulated)")
    experiment.save_figure(fig, ax, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exp = experiment.Experiment(args.name, args)
    for vocab, seq_len, batch in args.points:
        exp.run(f"vocab{vocab}-seq{seq_len}" + (f"-batch{batch}" if batch else ""),
                len(args.points), workload="lm", systems=args.systems, vocab=vocab,
                seq_len=seq_len, batch=batch or args.batch or compare.DEFAULT_BATCH["lm"])
    exp.write(summary(exp), lambda path: plot(exp, path), extra={"points": rows(exp)})
    return exp.exit_status()


if __name__ == "__main__":
    sys.exit(main())
