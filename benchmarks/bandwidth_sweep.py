"""Where does each system's advantage start and end? One workload at several link rates.

    python benchmarks/bandwidth_sweep.py --rates 100mbit 1gbit 5gbit
    python benchmarks/bandwidth_sweep.py --rates 100mbit 1gbit --systems hybrid ddp-dense \
        --machines 2 --nproc-per-machine 1 --steps 2 --warmup 1 --vocab 2000   # smoke size

runs compare.py once per rate (same cluster shape and workload) and writes
benchmarks/out/bandwidth-<machines>x<workers>.json (its ``sweep`` maps each rate to
compare's records, as before), .md (throughput per system and rate, and its ratio to the last
system, ddp-dense by default) and .png (throughput against rate, one line per system). Needs
root and iproute2; the network is emulated.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import compare
import experiment
from experiment import by_system, with_ratio


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", nargs="+", default=["100mbit", "1gbit", "5gbit"])
    parser.add_argument("--systems", nargs="+", choices=compare.ALL_SYSTEMS,
                        default=["hybrid", "allreduce", "ddp-sparse", "ddp-dense"],
                        help="the last is the ratios' base")
    parser.add_argument("--workload", choices=compare.WORKLOADS, default="lm")
    parser.add_argument("--name", help="output file stem (default bandwidth-<M>x<K>)")
    experiment.add_common_arguments(parser, steps=4, warmup=2)
    args = parser.parse_args(argv)
    args.name = args.name or f"bandwidth-{args.machines}x{args.nproc_per_machine}"
    return args


def sweep(exp: experiment.Experiment) -> dict[str, list[dict]]:
    """Rate -> compare's records (the JSON layout of the earlier version of this script)."""
    return {run["label"]: run["results"] for run in exp.runs if "results" in run}


def summary(exp: experiment.Experiment) -> str:
    args = exp.args
    base = args.systems[-1]
    lines = [f"Bandwidth sweep: {args.workload}, {args.machines} machines x "
             f"{args.nproc_per_machine} workers, {args.warmup} warm-up + {args.steps} timed "
             f"steps; throughput (vs {base})", "",
             "| system | " + " | ".join(args.rates) + " |", "|---" * (len(args.rates) + 1) + "|"]
    results = {run["label"]: by_system(run.get("results", [])) for run in exp.runs}
    for system in args.systems:
        cells = []
        for rate in args.rates:
            got = results.get(rate, {})
            cells.append(with_ratio(got.get(system, {}).get("items_per_s"),
                                    got.get(base, {}).get("items_per_s")))
        lines.append(f"| {system} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(exp: experiment.Experiment, path: Path) -> None:
    plt = experiment.pyplot()
    data = {rate: by_system(results) for rate, results in sweep(exp).items()}
    rates = [rate for rate in exp.args.rates if rate in data]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    unit = "items"
    for system in exp.args.systems:
        xy = [(rate, data[rate][system]["items_per_s"]) for rate in rates
              if system in data[rate]]
        if xy:
            unit = data[xy[0][0]][system]["unit"]
        ax.plot([x for x, _ in xy], [y for _, y in xy], marker="o", label=system)
    ax.set_xlabel("link rate (emulated)")
    ax.set_ylabel(f"{unit}/s")
    ax.set_yscale("log")
    ax.set_title(f"{exp.args.workload.upper()}, {exp.args.machines}x"
                 f"{exp.args.nproc_per_machine} workers")
    experiment.save_figure(fig, ax, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exp = experiment.Experiment(args.name, args)
    for rate in args.rates:
        exp.run(rate, len(args.rates), rate=rate, workload=args.workload,
                systems=args.systems)
    exp.write(summary(exp), lambda path: plot(exp, path), extra={"sweep": sweep(exp)})
    return exp.exit_status()


if __name__ == "__main__":
    sys.exit(main())
