"""Table 2 and Table 5 analogs (Parallax papers): step time at every partition count of a range
(brute force) next to the count the in-process search chooses, with its number of samples and
the time it took. Target (Table 5): the searched count within 6 % of the brute-force best, in at
most 6 samples.

    python benchmarks/partitions.py --machines 2 --nproc-per-machine 2 --rate 1gbit
    python benchmarks/partitions.py --machines 2 --nproc-per-machine 1 --partitions 1 2 4 \
        --steps 2 --settle 1 --vocab 2000          # smoke size

writes benchmarks/out/partitions-<workload>-<M>x<L>-<rate>.json, .md and .png. Brute force
uses one runner, re-partitioned in process between counts (``--settle`` untimed steps after
each re-partition, then ``--steps`` timed ones), in ``--rounds`` passes over all counts so that
the shared host's slow spells spread over them; the search run is a fresh runner over the
same program built inside ``parallax.partitioner()``, trained until the search has chosen
(``--search-steps`` steps per sample, the first half discarded), then timed for ``--steps``.
Needs root and iproute2 (emulated network: tbf-limited veths, no delay; all processes share
this host's cores).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import compare
import records

HERE = Path(__file__).resolve().parent
TARGET = 1.06
MAX_SAMPLES = 6
#: steps per search sample by default; the papers' is 100 (the first 50 dropped, as here)
SEARCH_STEPS = 6


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=["lm", "nmt", "recsys"], default="lm")
    parser.add_argument("--machines", type=int, default=2)
    parser.add_argument("--nproc-per-machine", type=int, default=2)
    parser.add_argument("--rate", default="1gbit",
                        help="emulated link rate (tc syntax); none: no emulated network (the "
                        "machines' processes talk over this host's loopback)")
    parser.add_argument("--partitions", type=int, nargs="+",
                        default=list(range(1, 17)) + [20, 24, 32],
                        help="brute-force counts (the search's largest is their maximum)")
    parser.add_argument("--steps", type=int, default=6,
                        help="timed steps per count and round")
    parser.add_argument("--rounds", type=int, default=2,
                        help="brute force passes over all counts (steps per count add up)")
    parser.add_argument("--settle", type=int, default=2,
                        help="untimed steps after each re-partition")
    parser.add_argument("--search-steps", type=int, default=SEARCH_STEPS,
                        help="Config.partition_search_steps: steps per search sample, the "
                        "first half dropped (the papers: 100)")
    parser.add_argument("--alpha-steps", type=int, default=3,
                        help="Config.sparsity_warmup_steps before anything is timed")
    parser.add_argument("--server-threads", type=int,
                        help="Config.server_threads (default: the torch thread count)")
    parser.add_argument("--vocab", type=int, default=100_000, help="lm")
    parser.add_argument("--emb", type=int, default=128, help="lm")
    parser.add_argument("--hidden", type=int, default=128, help="lm")
    parser.add_argument("--seq-len", type=int, default=20, help="lm")
    parser.add_argument("--sampled", type=int, default=512, help="lm")
    parser.add_argument("--batch", type=int, help="per worker")
    parser.add_argument("--workload-options", type=json.loads, default={})
    parser.add_argument("--hash-multiplier", type=int, default=1, help="recsys")
    parser.add_argument("--out-dir", type=Path, default=records.scratch())
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    if min(args.partitions) < 1 or args.steps < 1 or args.search_steps < 2 or args.rounds < 1:
        parser.error("--partitions must be >= 1, --steps and --rounds >= 1, --search-steps >= 2")
    args.partitions = sorted(set(args.partitions))
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    name = f"partitions-{args.workload}-{args.machines}x{args.nproc_per_machine}-{args.rate}"
    if args.search_steps != SEARCH_STEPS:
        name += f"-search{args.search_steps}"
    out = args.out_dir / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    worker_args = {"workload_name": args.workload,
                   "workload": compare.workload_options(args),
                   "partitions": args.partitions, "steps": args.steps, "settle": args.settle,
                   "rounds": args.rounds,
                   "search_steps": args.search_steps, "alpha_steps": args.alpha_steps,
                   "server_threads": args.server_threads, "out": str(out.resolve())}
    network = [] if args.rate == "none" else ["--emulate-network", args.rate]
    command = [sys.executable, "-m", "parallax.cli", "run", "--machines", str(args.machines),
               "--nproc-per-machine", str(args.nproc_per_machine), *network,
               str(HERE / "partitions_worker.py"), json.dumps(worker_args)]
    out.unlink(missing_ok=True)
    compare.fetch_data(args.workload, worker_args["workload"])  # workers cannot download
    proc = subprocess.run(command)
    if proc.returncode != 0 and not out.exists():
        raise RuntimeError(f"partitions: the workers failed (exit status {proc.returncode}); "
                           f"their errors are printed above")
    result = json.loads(out.read_text())
    result.update(command=" ".join(["python", "benchmarks/partitions.py", *sys.argv[1:]]),
                  options={k: (str(v) if isinstance(v, Path) else v)
                           for k, v in vars(args).items()},
                  verdict=verdict(result))
    out.write_text(json.dumps(result, indent=1))
    text = markdown(result, args)
    out.with_suffix(".md").write_text(text)
    print(text, flush=True)
    if not args.no_plot:
        plot(result, out.with_suffix(".png"), args)
    return result


def verdict(result: dict[str, Any]) -> dict[str, Any]:
    """The searched count's brute-force step time against the best one, with the worst one
    beside them (Table 5: brute force's minimum and maximum, the search's pick)."""
    brute = {r["partitions"]: r["median_step_s"] for r in result["brute_force"]}
    best = min(brute, key=brute.__getitem__)
    worst = max(brute, key=brute.__getitem__)
    chosen = result["search"]["partitions"]
    ratio = brute[chosen] / brute[best] if chosen in brute else None
    samples = len(result["search"]["samples"])
    return {"best_partitions": best, "best_step_s": brute[best], "chosen_partitions": chosen,
            "chosen_step_s": brute.get(chosen), "chosen_over_best": ratio,
            "worst_partitions": worst, "worst_step_s": brute[worst],
            "worst_over_best": brute[worst] / brute[best],
            "samples": samples,
            "met": ratio is not None and ratio <= TARGET and samples <= MAX_SAMPLES}


def markdown(result: dict[str, Any], args: argparse.Namespace) -> str:
    v = result["verdict"]
    search = result["search"]
    lines = [f"### Partition counts: {compare.describe(args)}, {args.machines}x"
             f"{args.nproc_per_machine} at {args.rate}", "",
             "| P | median ms/step | min | max | vs best |", "|---|---|---|---|---|"]
    for r in result["brute_force"]:
        marks = (" (best)" if r["partitions"] == v["best_partitions"] else "") + (
            " (worst)" if r["partitions"] == v["worst_partitions"] else "") + (
            " (searched)" if r["partitions"] == v["chosen_partitions"] else "")
        lines.append(f"| {r['partitions']}{marks} | {r['median_step_s'] * 1e3:.1f} | "
                     f"{r['step_min_s'] * 1e3:.1f} | {r['step_max_s'] * 1e3:.1f} | "
                     f"{r['median_step_s'] / v['best_step_s']:.3f} |")
    samples = ", ".join(f"P={s['partitions']}: {s['seconds'] * 1e3:.1f} ms"
                        for s in search["samples"])
    fit = ("none (fewer than 3 samples)" if not search["theta"] else
           "t(P) = {:.4g} + {:.4g}/P + {:.4g}·P s".format(*search["theta"]))
    ratio = v["chosen_over_best"]
    lines += ["", f"Search: P={v['chosen_partitions']} from {v['samples']} samples ({samples}); "
              f"fit {fit}; {search['search_seconds']:.1f} s of training "
              f"({search['steps_until_chosen']} steps including {search['alpha_steps']} warm-up"
              f" steps); afterwards {search['after']['median_step_s'] * 1e3:.1f} ms/step.",
              f"Searched P's brute-force time / best: "
              f"{'n/a' if ratio is None else f'{ratio:.3f}'} (target ≤ {TARGET}, in ≤ "
              f"{MAX_SAMPLES} samples): {'met' if v['met'] else 'NOT met'}.",
              f"Table 5: brute force's minimum P={v['best_partitions']} "
              f"{v['best_step_s'] * 1e3:.1f} ms, maximum P={v['worst_partitions']} "
              f"{v['worst_step_s'] * 1e3:.1f} ms ({v['worst_over_best']:.2f}x); searched "
              f"P={v['chosen_partitions']} {_ms(v['chosen_step_s'])}.",
              "", f"Command: `{result['command']}`"]
    return "\n".join(lines) + "\n"


def _ms(seconds: float | None) -> str:
    return "n/a (not in the brute force's range)" if seconds is None else f"{seconds * 1e3:.1f} ms"


def plot(result: dict[str, Any], path: Path, args: argparse.Namespace) -> None:
    import numpy as np
    from experiment import pyplot, save_figure

    brute = result["brute_force"]
    search = result["search"]
    fig, ax = pyplot().subplots(figsize=(7, 4))
    ax.plot([r["partitions"] for r in brute], [r["median_step_s"] * 1e3 for r in brute],
            "o-", label="brute force (median)")
    ax.plot([s["partitions"] for s in search["samples"]],
            [s["seconds"] * 1e3 for s in search["samples"]], "s", label="search samples")
    if search["theta"]:
        t0, t1, t2 = search["theta"]
        sampled = [s["partitions"] for s in search["samples"]]
        p = np.linspace(min(sampled), max(sampled), 200)  # the fit holds where it was sampled
        ax.plot(p, (t0 + t1 / p + t2 * p) * 1e3, "--", label="fitted t(P), sampled range")
    ax.axvline(search["partitions"], color="grey", linestyle=":", label="searched P")
    ax.set_xlabel("partitions P")
    ax.set_ylabel("ms per step")
    ax.set_title(f"{args.workload} {args.machines}x{args.nproc_per_machine} {args.rate}")
    save_figure(fig, ax, path)


if __name__ == "__main__":
    try:
        run(parse_args())
    except RuntimeError as error:
        sys.exit(str(error))
