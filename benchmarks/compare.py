"""Systems side by side on the emulated cluster, in one run: parallax's four architectures
against PyTorch DDP (dense-gradient and sparse-gradient embeddings) on the LM workload.

    python benchmarks/compare.py --machines 2 --nproc-per-machine 2 --rate 1gbit

writes benchmarks/results/compare-<machines>x<workers>-<rate>.json, a markdown table on stdout
and, unless --no-plot, a PNG next to the JSON (matplotlib: pip install -e '.[bench]').
Needs root and iproute2 (network namespaces, tc). The network is emulated (tbf-limited veths,
no delay), and all processes share this host's cores.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SYSTEMS = ["hybrid", "optps", "ps", "allreduce", "ddp-sparse", "ddp-dense"]
# Also: "hybrid-sparse" (and other "<architecture>-sparse"): the program with sparse=True
# embeddings under parallax; "hybrid-lazy": Config(lazy_sparse_updates=True);
# "torchrec-rw" / "torchrec-tw": TorchRec (recsys workload only).
ALL_SYSTEMS = [*SYSTEMS, "hybrid-sparse", "optps-sparse", "hybrid-lazy", "torchrec-rw",
               "torchrec-tw"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--machines", type=int, default=2)
    parser.add_argument("--nproc-per-machine", type=int, default=2)
    parser.add_argument("--rate", default="1gbit", help="link rate (tc syntax)")
    parser.add_argument("--systems", nargs="+", default=SYSTEMS, choices=ALL_SYSTEMS)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per system")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per system")
    parser.add_argument("--workload", choices=["lm", "cnn", "recsys"], default="lm",
                        help="lm: LSTM + sampled softmax on a Zipf stream; cnn: small ResNet "
                        "on Fashion-MNIST (every parameter dense); recsys: embeddings + MLP on "
                        "MovieLens-100k (needs benchmarks/setup_bench.sh)")
    parser.add_argument("--hash-multiplier", type=int, default=1,
                        help="recsys: table rows = ids x this (large, sparsely used tables)")
    parser.add_argument("--vocab", type=int, default=100_000)
    parser.add_argument("--emb", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--batch", type=int, help="per worker (default: lm 16, cnn 64)")
    parser.add_argument("--out", type=Path, help="results JSON (default under results/)")
    parser.add_argument("--no-plot", action="store_true")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> list[dict]:
    out = args.out or (HERE / "results" / f"compare-{args.workload}-{args.machines}x"
                                          f"{args.nproc_per_machine}-{args.rate}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.workload == "lm":
        options = {"vocab": args.vocab, "emb": args.emb, "hidden": args.hidden,
                   "batch": options_batch(args)}
    elif args.workload == "recsys":
        options = {"emb": 32, "hidden": 64, "batch": options_batch(args),
                   "hash_multiplier": args.hash_multiplier}
    else:
        options = {"batch": options_batch(args)}
    worker_args = {"systems": args.systems, "steps": args.steps, "warmup": args.warmup,
                   "out": str(out.resolve()), "workload_name": args.workload,
                   "workload": options}
    cmd = [sys.executable, "-m", "parallax.cli", "run", "--machines", str(args.machines),
           "--nproc-per-machine", str(args.nproc_per_machine), "--emulate-network", args.rate,
           str(HERE / "compare_worker.py"), json.dumps(worker_args)]
    subprocess.run(cmd, check=True)
    results = json.loads(out.read_text())
    print(markdown(results, args))
    if not args.no_plot:
        plot(results, out.with_suffix(".png"), args)
    return results


def options_batch(args: argparse.Namespace) -> int:
    return args.batch or {"lm": 16, "cnn": 64, "recsys": 256}[args.workload]


def markdown(results: list[dict], args: argparse.Namespace) -> str:
    done = [r for r in results if "unavailable" not in r]
    base = next((r for r in done if r["system"] == "ddp-dense"), done[-1])
    unit = done[0]["unit"]
    what = {"lm": f"LM vocab {args.vocab:,}, emb {args.emb}, hidden {args.hidden}",
            "cnn": "small ResNet on Fashion-MNIST",
            "recsys": f"recommender on MovieLens-100k, tables x{args.hash_multiplier}"}[
                args.workload]
    lines = [f"{args.machines} machines x {args.nproc_per_machine} workers, {args.rate} "
             f"(emulated), {what}, batch {options_batch(args)}"
             f"/worker", "",
             f"| system | step (ms, median) | {unit}/s | vs {base['system']} | "
             "wire bytes/machine/step |", "|---|---|---|---|---|"]
    for r in results:
        if "unavailable" in r:
            lines.append(f"| {r['system']} | unavailable: {r['unavailable']} | | | |")
            continue
        lines.append(f"| {r['system']} | {1e3 * r['median_step_s']:.0f} | "
                     f"{r['items_per_s']:,.0f} | "
                     f"{r['items_per_s'] / base['items_per_s']:.2f}x | "
                     f"{r['wire_bytes_per_machine_step']:,.0f} |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    results = [r for r in results if "unavailable" not in r]
    ax.bar([r["system"] for r in results], [r["items_per_s"] for r in results])
    ax.set_ylabel(f"{results[0]['unit']}/s")
    ax.set_title(f"{args.workload.upper()}, {args.machines}x{args.nproc_per_machine} workers, "
                 f"{args.rate} (emulated)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    run(parse_args())
