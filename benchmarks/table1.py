"""Table 1 analog (Parallax, EuroSys'19): PS against AllReduce throughput on four workloads,
with each workload's α_model.

    python benchmarks/table1.py --rate 1gbit
    python benchmarks/table1.py --workloads lm cnn --machines 2 --nproc-per-machine 1 \
        --steps 2 --warmup 1 --vocab 2000            # smoke size

runs compare.py once per workload (systems ``ps`` and ``allreduce``: parallax's TF-PS-like and
Horovod-like architectures, by default) and writes benchmarks/out/table1.json, .md and
.png (throughput normalised to the first system, per workload). Needs root and iproute2.
nmt and recsys fetch their data on first use (recsys needs benchmarks/setup_bench.sh); a
workload that fails is recorded as failed, the others still run, and the exit status is 1.
table4.py is this script with other defaults.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import compare
import experiment
from experiment import alpha_model, by_system, cell, link_share, with_ratio

TITLE = "Table 1 analog: PS vs AllReduce"


def parse_args(argv: list[str] | None = None, *, description: str = __doc__,
               workloads: list[str] = compare.WORKLOADS,
               systems: tuple[str, ...] = ("ps", "allreduce"),
               name: str = "table1") -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", choices=compare.WORKLOADS, default=workloads)
    parser.add_argument("--systems", nargs="+", choices=compare.ALL_SYSTEMS,
                        default=list(systems), help="the first is the ratios' base")
    parser.add_argument("--hash-multiplier", type=int, default=1000,
                        help="recsys: table rows = ids x this (as in BENCHMARKS.md)")
    parser.add_argument("--nmt-options", type=json.loads, default={},
                        help="the NMT's workload options as JSON (e.g. its vocabularies and "
                        "widths, to bring its α and dense share to the paper's)")
    parser.add_argument("--name", default=name, help="output file stem")
    experiment.add_common_arguments(parser)
    return parser.parse_args(argv)


def summary(exp: experiment.Experiment, systems: list[str], title: str) -> str:
    """One row per workload: α_model, each system's throughput (and its ratio to the first
    system's) and wire bytes per machine and step."""
    base = systems[0]
    head = ["workload", "unit", "α_model", *(f"{s} /s (vs {base})" for s in systems),
            *(f"{s} wire B/machine/step" for s in systems),
            *(f"{s} link share" for s in systems)]
    lines = [f"{title}: {exp.args.machines} machines x {exp.args.nproc_per_machine} workers, "
             f"{exp.args.rate} (emulated){', processes pinned' if exp.args.pin else ''}, "
             f"{exp.args.warmup} warm-up + {exp.args.steps} timed steps; link share: half the "
             "machine's wire bytes at the nominal rate over the step", "",
             "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for run in exp.runs:
        if "error" in run:
            lines.append(f"| {run['label']} | failed |" + " |" * (len(head) - 2))
            continue
        got = by_system(run["results"])
        unit = next(iter(got.values()))["unit"] if got else ""
        rate = {s: got[s]["items_per_s"] if s in got else None for s in systems}
        lines.append("| " + " | ".join([
            run["label"], unit, cell(alpha_model(run["results"]), ".3f"),
            *(with_ratio(rate[s], rate[base]) for s in systems),
            *(cell(got[s]["wire_bytes_per_machine_step"] if s in got else None)
              for s in systems),
            *(cell(link_share(got[s], exp.args.rate) if s in got else None, ".2f")
              for s in systems)]) + " |")
    return "\n".join(lines)


def plot(exp: experiment.Experiment, systems: list[str], title: str, path: Path) -> None:
    """Grouped bars: per workload, each system's throughput over the first system's."""
    plt = experiment.pyplot()
    runs = [r for r in exp.runs if "results" in r]
    fig, ax = plt.subplots(figsize=(2.4 + 1.6 * len(runs), 3.6))
    width = 0.8 / len(systems)
    for i, system in enumerate(systems):
        values = []
        for run in runs:
            got = by_system(run["results"])
            base = got.get(systems[0], {}).get("items_per_s")
            values.append(got[system]["items_per_s"] / base if system in got and base else 0)
        ax.bar([j + i * width for j in range(len(runs))], values, width, label=system)
    ax.set_xticks([j + width * (len(systems) - 1) / 2 for j in range(len(runs))],
                  [f"{r['label']}\nα_model {cell(alpha_model(r['results']), '.3f')}"
                   for r in runs])
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_ylabel(f"throughput / {systems[0]}")
    ax.set_title(f"{title}, {exp.args.machines}x{exp.args.nproc_per_machine}, "
                 f"{exp.args.rate} (emulated)", fontsize=10)
    experiment.save_figure(fig, ax, path)


def run(args: argparse.Namespace, title: str) -> int:
    """One compare run per workload, then the outputs; the exit status."""
    exp = experiment.Experiment(args.name, args)
    for workload in args.workloads:
        exp.run(workload, len(args.workloads), workload=workload, systems=args.systems,
                hash_multiplier=args.hash_multiplier,
                workload_options=args.nmt_options if workload == "nmt" else {})
    exp.write(summary(exp, args.systems, title),
              lambda path: plot(exp, args.systems, title, path))
    return exp.exit_status()


if __name__ == "__main__":
    sys.exit(run(parse_args(), TITLE))
