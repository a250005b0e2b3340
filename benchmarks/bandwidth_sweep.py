"""Where does each system's advantage start and end? The LM comparison at several link rates.

    python benchmarks/bandwidth_sweep.py --rates 100mbit 1gbit 5gbit

runs benchmarks/compare.py once per rate (same cluster shape and workload) and writes
benchmarks/results/bandwidth-<machines>x<workers>.json and .png (words/s against rate, one
line per system). Needs root and iproute2; the network is emulated.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import compare

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", nargs="+", default=["100mbit", "1gbit", "5gbit"])
    parser.add_argument("--machines", type=int, default=2)
    parser.add_argument("--nproc-per-machine", type=int, default=2)
    parser.add_argument("--systems", nargs="+",
                        default=["hybrid", "allreduce", "ddp-sparse", "ddp-dense"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args()
    shape = f"{args.machines}x{args.nproc_per_machine}"
    sweep = {}
    for rate in args.rates:
        run_args = compare.parse_args([
            "--machines", str(args.machines), "--nproc-per-machine",
            str(args.nproc_per_machine), "--rate", rate, "--steps", str(args.steps),
            "--warmup", "2", "--systems", *args.systems, "--no-plot",
            "--out", str(HERE / "results" / f"compare-lm-{shape}-{rate}.json")])
        sweep[rate] = compare.run(run_args)
    out = HERE / "results" / f"bandwidth-{shape}.json"
    out.write_text(json.dumps(sweep, indent=1))
    if not args.no_plot:
        plot(sweep, out.with_suffix(".png"), shape)


def plot(sweep: dict[str, list[dict]], path: Path, shape: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = list(sweep)
    systems = [r["system"] for r in sweep[rates[0]]]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for system in systems:
        ax.plot(rates, [next(r["items_per_s"] for r in sweep[rate] if r["system"] == system)
                        for rate in rates], marker="o", label=system)
    ax.set_xlabel("link rate (emulated)")
    ax.set_ylabel("words/s")
    ax.set_yscale("log")
    ax.set_title(f"LM, {shape} workers")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
