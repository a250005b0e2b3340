"""Synchronous against asynchronous training (`Config.sync`): throughput and training loss
against wall-clock time, with and without a straggler, on emulated machines.

    python benchmarks/async_training.py --workloads lm recsys --layouts 4x1 2x2 \
        --rate 1gbit --steps 150 --repeats 3
    python benchmarks/async_training.py --workloads lm --layouts 2x2 --steps 10 \
        --warmup 2 --repeats 1 --out-dir /tmp/smoke                     # smoke size

Modes: ``sync`` (the hybrid, every step aggregated), ``async-sparse`` (Persia's: dense layers
AllReduced, sparse rows through asynchronous servers, no staleness bound), ``async`` (every
parameter on asynchronous servers, no bound). Same work in each: ``--steps`` steps per
worker, or as many steps in all under ``async``, whichever workers do them. Straggler: the
last rank sleeps twice its own step time after each step (3x slower). Workloads: the LM on
the KJV Bible (Adagrad) and the MovieLens-100k recommender (tables x ``--hash-multiplier``).

Per (workload, layout, straggler, mode), over ``--repeats`` launches (the modes' order
rotated): throughput (words or samples per second: the work done over the wall-clock time
until the last worker ended), and the training loss: every worker's step losses pooled and
ordered by time, the mean of the last fifth (the same amount of work in every mode), and a
curve of the median-throughput repeat (mean loss per twelfth of its time). Writes
``<out-dir>/async.json`` (raw records and provenance), ``async.md`` and ``async.png``.
The network is emulated (tbf-limited veths, no delay); all workers share this host's cores.
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
from data_fetch import fetch_data  # noqa: E402

MODES = ["sync", "async-sparse", "async"]
LAYOUTS = {"4x1": (4, 1), "2x2": (2, 2)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["lm", "recsys"],
                        choices=["lm", "recsys"])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--steps", type=int, default=150, help="per worker")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per worker")
    parser.add_argument("--hash-multiplier", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    parser.add_argument("--out-dir", type=Path, default=records.scratch())
    parser.add_argument("--figure", type=Path, default=HERE / "figures" / "async.png")
    parser.add_argument("--from-json", type=Path, metavar="FILE",
                        help="rebuild the table and figure from an earlier run's JSON")
    return parser.parse_args(argv)


def workload_options(name: str, args: argparse.Namespace) -> dict[str, Any]:
    if name == "lm":
        return {"corpus": "kjv", "batch": 16}
    return {"hash_multiplier": args.hash_multiplier, "batch": 256}


def launch(args: argparse.Namespace, workload: str, layout: str, straggler: bool,
           repeat: int) -> list[dict[str, Any]]:
    machines, per_machine = LAYOUTS[layout]
    modes = args.modes[repeat % len(args.modes):] + args.modes[:repeat % len(args.modes)]
    out = args.out_dir / f".async-{workload}-{layout}-{int(straggler)}-{repeat}.json"
    worker_args = {"modes": modes, "steps": args.steps, "warmup": args.warmup,
                   "straggler": straggler, "workload_name": workload,
                   "workload": workload_options(workload, args), "out": str(out.resolve())}
    cmd = [sys.executable, "-m", "parallax.cli", "run", "--machines", str(machines),
           "--nproc-per-machine", str(per_machine), "--emulate-network", args.rate,
           str(HERE / "async_bench_worker.py"), json.dumps(worker_args)]
    out.unlink(missing_ok=True)
    subprocess.run(cmd, check=True)
    records = json.loads(out.read_text())
    out.unlink()
    return records


def measure(record: dict[str, Any]) -> dict[str, Any]:
    """One launch's numbers for one mode."""
    ranks = record["ranks"]
    wall = max(r["finished_s"] for r in ranks)
    steps = sum(r["steps"] for r in ranks)
    pooled = sorted((t, loss) for r in ranks for t, loss in r["records"])
    tail = pooled[-max(1, len(pooled) // 5):]
    bins = 12
    curve = []
    for b in range(bins):
        lo, hi = wall * b / bins, wall * (b + 1) / bins
        inside = [loss for t, loss in pooled if lo <= t < hi or (b == bins - 1 and t == hi)]
        if inside:
            curve.append({"seconds": (lo + hi) / 2, "loss": statistics.fmean(inside)})
    return {"wall_s": wall, "steps": steps,
            "items_per_s": steps * record["items_per_step"] / wall,
            "unit": record["unit"], "loss_last_fifth": statistics.fmean(loss for _, loss in tail),
            "steps_per_rank": [r["steps"] for r in ranks], "curve": curve}


def summarise(raw: dict[str, list[list[dict[str, Any]]]]) -> dict[str, dict[str, Any]]:
    """Per cell and mode, medians over repeats (and every repeat's values)."""
    out: dict[str, dict[str, Any]] = {}
    for cell, repeats in raw.items():
        measured = [{r["mode"]: measure(r) for r in launch_records} for launch_records in repeats]
        out[cell] = {}
        for mode in measured[0]:
            runs = [m[mode] for m in measured]
            order = sorted(range(len(runs)), key=lambda i: runs[i]["items_per_s"])
            median = runs[order[len(order) // 2]]
            out[cell][mode] = {
                "items_per_s": statistics.median(r["items_per_s"] for r in runs),
                "items_per_s_all": [r["items_per_s"] for r in runs],
                "loss_last_fifth": statistics.median(r["loss_last_fifth"] for r in runs),
                "loss_last_fifth_all": [r["loss_last_fifth"] for r in runs],
                "wall_s": statistics.median(r["wall_s"] for r in runs),
                "steps_per_rank": median["steps_per_rank"], "unit": median["unit"],
                "curve": median["curve"]}
    return out


def markdown(summary: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [f"{args.steps} steps per worker after {args.warmup} untimed (as many in all under "
             f"`async`), emulated {args.rate} links, medians over {args.repeats} repeats "
             f"(each repeat's values in brackets). Loss: the mean training loss of the last "
             f"fifth of all workers' steps (the same work in every mode). Straggler: the last "
             f"rank sleeps twice its own step time after each step.", "",
             "| workload, layout | straggler | mode | throughput | vs sync | loss, last fifth "
             "| steps per rank (median repeat) |", "|---" * 7 + "|"]
    for cell, modes in summary.items():
        workload, layout, straggler = cell.split("/")
        base = modes.get("sync", {}).get("items_per_s")
        for mode, row in modes.items():
            every = ", ".join(f"{v:,.0f}" for v in row["items_per_s_all"])
            losses = ", ".join(f"{v:.3f}" for v in row["loss_last_fifth_all"])
            ratio = f"{row['items_per_s'] / base:.2f}x" if base else "-"
            lines.append(
                f"| {workload} {layout} | {straggler} | {mode} | {row['items_per_s']:,.0f} "
                f"{row['unit']}/s [{every}] | {ratio} | {row['loss_last_fifth']:.3f} "
                f"[{losses}] | {row['steps_per_rank']} |")
    return "\n".join(lines) + "\n"


def plot(summary: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = list(summary)
    columns = 2
    rows = (len(cells) + columns - 1) // columns
    fig, axes = plt.subplots(rows, columns, figsize=(6 * columns, 3.6 * rows), squeeze=False)
    for ax, cell in zip(axes.flat, cells, strict=False):
        for mode, row in summary[cell].items():
            ax.plot([p["seconds"] for p in row["curve"]], [p["loss"] for p in row["curve"]],
                    marker="o", markersize=3, label=f"{mode} ({row['items_per_s']:,.0f} "
                                                    f"{row['unit']}/s)")
        ax.set_title(f"{cell} (emulated)")
        ax.set_xlabel("wall-clock time (s)")
        ax.set_ylabel("training loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(cells):]:
        ax.set_visible(False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        raw, run_args = saved["raw"], argparse.Namespace(**{**vars(args), **saved["options"]})
    else:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        for workload in args.workloads:
            fetch_data(workload, workload_options(workload, args))
        raw: dict[str, list[list[dict[str, Any]]]] = {}
        for repeat in range(args.repeats):
            for workload in args.workloads:
                for layout in args.layouts:
                    for straggler in (False, True):
                        cell = f"{workload}/{layout}/{'yes' if straggler else 'no'}"
                        print(f"[async] repeat {repeat + 1}/{args.repeats}: {cell}", flush=True)
                        raw.setdefault(cell, []).append(
                            launch(args, workload, layout, straggler, repeat))
        run_args = args
        options = {k: v for k, v in vars(args).items()
                   if k not in ("out_dir", "figure", "from_json")}
        (args.out_dir / "async.json").write_text(json.dumps(
            {"options": options, "provenance": provenance(), "raw": raw}, indent=1))
    summary = summarise(raw)
    table = markdown(summary, run_args)
    (args.out_dir / "async.md").write_text(table)
    plot(summary, args.figure)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
