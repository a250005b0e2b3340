"""Scaling (the papers' Figure 9 analog): throughput on 1, 2, 4 and 8 machines, normalised to
the 1-machine run of the same system.

    python benchmarks/scaling.py --rate 1gbit
    python benchmarks/scaling.py --machines 1 2 --systems hybrid ddp-dense --steps 2 \
        --warmup 1 --vocab 2000                       # smoke size

runs compare.py once per machine count (1 worker per machine unless --nproc-per-machine; the
batch per worker is fixed, so the global batch grows with the cluster: weak scaling, as in the
papers) and writes benchmarks/out/scaling.json, .md and .png. Normalised throughput of a
system on M machines = its throughput there / its throughput on the fewest machines run (1 by
default); linear scaling gives M. Needs root and iproute2; every machine shares this host's
cores, so the larger clusters are compute-bound here long before the network limits them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import compare
import experiment
from experiment import by_system, cell


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--machines", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--systems", nargs="+", choices=compare.ALL_SYSTEMS,
                        default=["hybrid", "ddp-dense", "ddp-sparse"])
    parser.add_argument("--workload", choices=compare.WORKLOADS, default="lm")
    parser.add_argument("--hash-multiplier", type=int, default=1000, help="recsys")
    parser.add_argument("--name", default="scaling", help="output file stem")
    experiment.add_common_arguments(parser, shape=False)
    args = parser.parse_args(argv)
    if min(args.machines) < 1:
        parser.error("--machines must be >= 1")
    args.machines = sorted(set(args.machines))
    return args


def normalised(exp: experiment.Experiment, system: str) -> dict[int, float]:
    """Machines -> throughput over the same system's throughput on the fewest machines."""
    rates = {}
    for run in exp.runs:
        got = by_system(run.get("results", []))
        if system in got:
            rates[run["settings"]["machines"]] = got[system]["items_per_s"]
    if not rates:
        return {}
    base = rates[min(rates)]
    return {m: rate / base for m, rate in sorted(rates.items())}


def summary(exp: experiment.Experiment) -> str:
    args = exp.args
    first = args.machines[0]
    head = ["machines", "workers", *(f"{s} /s (normalised)" for s in args.systems),
            "linear", *(f"{s} wire B/machine/step" for s in args.systems)]
    lines = [f"Scaling: {args.workload}, {args.nproc_per_machine} worker(s) per machine, "
             f"{args.rate} (emulated), {args.warmup} warm-up + {args.steps} timed steps; "
             f"throughput normalised to the same system on {first} machine(s)", "",
             "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    norm = {s: normalised(exp, s) for s in args.systems}
    for run in exp.runs:
        machines = run["settings"]["machines"]
        if "error" in run:
            lines.append(f"| {machines} | failed |" + " |" * (len(head) - 2))
            continue
        got = by_system(run["results"])
        lines.append("| " + " | ".join([
            str(machines), str(machines * args.nproc_per_machine),
            *(f"{cell(got[s]['items_per_s'] if s in got else None)} "
              f"({cell(norm[s].get(machines), '.2f')}x)" for s in args.systems),
            f"{machines / first:.0f}x",
            *(cell(got[s]["wire_bytes_per_machine_step"] if s in got else None)
              for s in args.systems)]) + " |")
    return "\n".join(lines)


def plot(exp: experiment.Experiment, path: Path) -> None:
    plt = experiment.pyplot()
    args = exp.args
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    first = args.machines[0]
    ax.plot(args.machines, [m / first for m in args.machines], "k--", linewidth=0.8,
            label="linear")
    for system in args.systems:
        points = normalised(exp, system)
        ax.plot(list(points), list(points.values()), marker="o", label=system)
    ax.set_xscale("log", base=2)
    ax.set_xticks(args.machines, [str(m) for m in args.machines])
    ax.set_xlabel(f"machines ({args.nproc_per_machine} worker(s) each)")
    ax.set_ylabel(f"throughput / {first}-machine throughput")
    ax.set_title(f"{args.workload.upper()} scaling, {args.rate} (emulated)")
    experiment.save_figure(fig, ax, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exp = experiment.Experiment(args.name, args)
    for machines in args.machines:
        exp.run(f"{machines}x{args.nproc_per_machine}", len(args.machines), machines=machines,
                workload=args.workload, systems=args.systems,
                hash_multiplier=args.hash_multiplier)
    exp.write(summary(exp), lambda path: plot(exp, path),
              extra={"normalised": {s: normalised(exp, s) for s in args.systems}})
    return exp.exit_status()


if __name__ == "__main__":
    sys.exit(main())
