"""Analogs of the batch / model / integrated parallelism report's Figures 5-7: strong scaling
of fully connected ReLU networks (3 hidden layers of one width) trained with minibatch SGD,
P = 1, 2, 4, 8 processes, one per emulated machine, under every grid ``data x model`` of P;
and the grid ``Config(parallelism="auto")`` picks against the fastest one measured.

    python benchmarks/model_parallel.py --data airfoil --widths 32 64 128 512 1024 \
        --processes 1 2 4 8 --rate 1gbit --steps 150
    python benchmarks/model_parallel.py --data synthetic --rows 700000 --widths 512 1024 \
        --processes 1 2 4 8 --steps 60
    python benchmarks/model_parallel.py --data airfoil --widths 32 --processes 1 2 \
        --steps 6 --warmup 2 --replay 2 --out-dir /tmp/smoke           # smoke size
    python benchmarks/model_parallel.py --rate none --model-split every-layer ...

``--rate none`` runs the processes unshaped over this host's loopback (the report's fast link;
on 2 cores P >= 4 is partly modelled as below); ``--model-split every-layer`` splits every
layer with its output gathered (the report's scheme) instead of pairs.

Data: the UC Irvine Airfoil Self-Noise set (1,503 rows; all 5 features: frequency, angle of
attack, chord length, free-stream velocity, suction-side displacement thickness; target:
scaled sound pressure; all standardised), or a *synthetic* regression set of UCI Ethylene's
shape (``--rows`` x 16 -> 2; no copy of Ethylene is available offline). Global batch 96 (the
report's 100, rounded so that every P divides it); 150 steps of 96 are ~10 epochs of airfoil.

What is measured and what is modelled (the host has 2 cores): per (width, grid) the worker
records the wall-clock step (``wall``: real for P <= 2; for P >= 4 the P processes share 2
cores), the step's collectives replayed alone on the emulated network (``comm``: measured)
and one process's single-thread share of the compute alone (``compute``: measured).
``measured`` speedups use ``wall`` for P <= 2 and ``comm + compute`` for P >= 4 (partly
modelled: the sum assumes no overlap and a core per process). ``predicted`` is the cost
model's (`parallax.parallelism.cost`) with the α, β measured at start-up. Needs root and
iproute2 for P >= 2.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import records  # noqa: E402
from compare import provenance  # noqa: E402

AIRFOIL = HERE.parent.parent / "shared" / "data" / "airfoil_self_noise.dat"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", choices=["airfoil", "synthetic"], default="airfoil")
    parser.add_argument("--airfoil", type=Path, default=AIRFOIL)
    parser.add_argument("--rows", type=int, default=700_000, help="synthetic rows")
    parser.add_argument("--widths", type=int, nargs="+", default=[32, 64, 128, 512, 1024])
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--rate", default="1gbit",
                        help="emulated link rate (tc syntax), or 'none': no emulation, the "
                        "processes talk over this host's loopback (an unshaped, fast link)")
    parser.add_argument("--model-split", choices=["pairs", "every-layer"], default="pairs",
                        help="Config.model_split of the model and integrated grids: pairs, "
                        "or every layer's output gathered (the report's own scheme)")
    parser.add_argument("--batch", type=int, default=96, help="global batch")
    parser.add_argument("--hidden", type=int, default=3, help="hidden layers")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=10, help="untimed first steps")
    parser.add_argument("--replay", type=int, default=10, help="timed collective replays")
    parser.add_argument("--out-dir", type=Path, default=records.scratch())
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--name", default=None,
                        help="the output's stem (default model_parallel-DATA-RATE)")
    return parser.parse_args(argv)


def grids(p: int) -> list[list[int]]:
    return [[p // m, m] for m in range(1, p + 1) if p % m == 0]


def launch(args: argparse.Namespace, p: int, out: Path) -> dict[str, Any]:
    options = {"data": args.data, "airfoil": str(args.airfoil), "rows": args.rows,
               "widths": args.widths, "grids": grids(p), "world": p, "batch": args.batch,
               "hidden": args.hidden, "steps": args.steps, "warmup": args.warmup,
               "replay": args.replay, "out": str(out), "model_split": args.model_split}
    network = ["--emulate-network", args.rate] if p > 1 and args.rate != "none" else []
    cmd = [sys.executable, "-m", "parallax.cli", "run", "--machines", str(p),
           "--nproc-per-machine", "1", *network, str(HERE / "model_parallel_worker.py"),
           json.dumps(options)]
    out.unlink(missing_ok=True)
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())


def measured_s(record: dict[str, Any]) -> float:
    """The step time the figures use: wall-clock up to P = 2, comm + compute above."""
    if record["world"] <= 2:
        return record["wall_s"]
    return record["replay_comm_s"] + record["compute_s"]


def predicted_s(record: dict[str, Any]) -> float:
    p = record["predicted"][f"{record['grid'][0]}x{record['grid'][1]}"]
    return p["comm_s"] + p["compute_s"]


def mode_of(grid: list[int]) -> str:
    data, model = grid
    return "batch" if model == 1 else ("model" if data == 1 else "integrated")


def summarise(runs: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    base = {r["width"]: r for r in runs.get(1, {"records": []})["records"]}
    for p, run in sorted(runs.items()):
        for r in run["records"]:
            one = base.get(r["width"])
            rows.append({"width": r["width"], "P": p, "grid": f"{r['grid'][0]}x{r['grid'][1]}",
                         "mode": mode_of(r["grid"]) if p > 1 else "serial",
                         "wall_ms": r["wall_s"] * 1e3, "comm_ms": r["replay_comm_s"] * 1e3,
                         "compute_ms": r["compute_s"] * 1e3,
                         "measured_ms": measured_s(r) * 1e3,
                         "predicted_ms": predicted_s(r) * 1e3,
                         "speedup": (measured_s(one) / measured_s(r)) if one else None,
                         "predicted_speedup": (predicted_s(one) / predicted_s(r)) if one
                         else None,
                         "model_bytes": r["bytes"].get("model", 0.0),
                         "data_bytes": r["bytes"].get("data", 0.0),
                         "final_mse": r["final_mse"], "auto": r["auto"]})
    return rows


def auto_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for key in sorted({(r["width"], r["P"]) for r in rows if r["P"] > 1}):
        mine = [r for r in rows if (r["width"], r["P"]) == key]
        fastest = min(mine, key=lambda r: r["measured_ms"])
        pick = mine[0]["auto"]
        picked = next(r for r in mine if r["grid"] == pick)
        out.append({"width": key[0], "P": key[1], "auto": pick, "fastest": fastest["grid"],
                    "match": pick == fastest["grid"],
                    "auto_vs_fastest": picked["measured_ms"] / fastest["measured_ms"]})
    return out


def markdown(rows: list[dict[str, Any]], auto: list[dict[str, Any]],
             args: argparse.Namespace) -> str:
    lines = [f"Data {args.data}, global batch {args.batch}, {args.hidden} hidden layers, "
             f"{args.steps} steps, link {link_words(args)} for P >= 2, model split "
             f"{args.model_split}. measured = wall "
             f"for P <= 2, replayed comm + single-thread compute for P >= 4 (partly "
             f"modelled).", "",
             "| width | P | grid | mode | wall ms | comm ms | compute ms | measured ms | "
             "predicted ms | speedup | predicted speedup | model B | data B | final MSE |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        sp = "" if r["speedup"] is None else f"{r['speedup']:.2f}"
        ps = "" if r["predicted_speedup"] is None else f"{r['predicted_speedup']:.2f}"
        lines.append(f"| {r['width']} | {r['P']} | {r['grid']} | {r['mode']} | "
                     f"{r['wall_ms']:.2f} | {r['comm_ms']:.2f} | {r['compute_ms']:.2f} | "
                     f"{r['measured_ms']:.2f} | {r['predicted_ms']:.2f} | {sp} | {ps} | "
                     f"{r['model_bytes']:.0f} | {r['data_bytes']:.0f} | {r['final_mse']:.4f} |")
    lines += ["", "| width | P | auto picks | fastest measured | same | auto's time / fastest |",
              "|---|---|---|---|---|---|"]
    for a in auto:
        lines.append(f"| {a['width']} | {a['P']} | {a['auto']} | {a['fastest']} | "
                     f"{'yes' if a['match'] else 'no'} | {a['auto_vs_fastest']:.2f} |")
    return "\n".join(lines) + "\n"


def link_words(args: argparse.Namespace) -> str:
    return ("none (this host's loopback, unshaped)" if args.rate == "none"
            else f"{args.rate} (emulated)")


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = ["batch", "model", "integrated"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5), sharey=True)
    widths = sorted({r["width"] for r in rows})
    colours = dict(zip(widths, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    for ax, mode in zip(axes, modes, strict=True):
        for width in widths:
            points = {}
            for r in rows:
                if r["width"] != width or r["speedup"] is None:
                    continue
                if r["P"] == 1 or r["mode"] == mode:
                    best = points.get(r["P"])
                    if best is None or r["speedup"] > best["speedup"]:
                        points[r["P"]] = r
            if len(points) < 2:
                continue
            ps = sorted(points)
            ax.plot(ps, [points[p]["speedup"] for p in ps], "o-", color=colours[width],
                    label=f"width {width} measured")
            ax.plot(ps, [points[p]["predicted_speedup"] for p in ps], "x--",
                    color=colours[width], alpha=0.6, label=f"width {width} predicted")
        ax.set_title(f"{mode} parallelism")
        ax.set_xlabel("processes P (P >= 4: partly modelled)")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("speedup over P = 1")
    axes[-1].legend(fontsize=7, ncol=2)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.data == "airfoil" and not args.airfoil.is_file():
        raise SystemExit(f"--airfoil {args.airfoil}: no such file (the UCI Airfoil Self-Noise "
                         f"set, tab-separated with a header line; or use --data synthetic)")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    runs = {}
    for p in args.processes:
        runs[p] = launch(args, p, args.out_dir / f"model_parallel-{args.data}-P{p}.raw.json")
        print(f"P={p} done", flush=True)
    rows = summarise(runs)
    auto = auto_table(rows)
    stem = args.name or f"model_parallel-{args.data}-{args.rate}" + (
        "" if args.model_split == "pairs" else f"-{args.model_split}")
    report = {"provenance": provenance(), "options": {k: str(v) if isinstance(v, Path) else v
                                                      for k, v in vars(args).items()},
              "runs": {str(p): run for p, run in runs.items()}, "rows": rows, "auto": auto}
    (args.out_dir / f"{stem}.json").write_text(json.dumps(report, indent=1))
    (args.out_dir / f"{stem}.md").write_text(markdown(rows, auto, args))
    for p in args.processes:
        (args.out_dir / f"model_parallel-{args.data}-P{p}.raw.json").unlink(missing_ok=True)
    if not args.no_plot:
        plot(rows, args.out_dir / f"{stem}.png",
             f"Strong scaling, {args.data}, batch {args.batch} ({link_words(args)}"
             f"{', every layer gathered' if args.model_split != 'pairs' else ''})")
    print(markdown(rows, auto, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
