"""Time to quality (the Parallax paper's Figure 7 analog): the LM on real text (the KJV Bible)
or the NMT (English -> Spanish Bible verses) trained by each system from the same initial
weights on the same batches until its full-softmax validation loss on held-out text reaches a
target; wall-clock training time to the target, per system, link rate and seed.

    python benchmarks/time_to_quality.py --rates 1gbit 100mbit --seeds 0 1 2
    python benchmarks/time_to_quality.py --workload nmt --eval-every 10 --max-steps 300

The LM's validation set is the KJV's held-out tail (windows); the NMT's, the corpus's last
``NMT_HELD_OUT`` verse pairs (its last books), which its training never reads.

Each (rate, seed) round runs every system once, each in its own launch, in an order rotated
by the seed. A run evaluates at step 0 and every ``--eval-every`` steps (not timed: the
validation pass is the same work for every system, and the hybrid's pulls the whole output
table for it) and stops at the first evaluation at or below ``--target``. The times are
training steps only, from step 1 (the hybrid's α warm-up counts), not the build. Writes
``<out-dir>/<name>.json`` (every run's curve, with provenance), ``.md`` (the summary) and
``.png`` (validation loss against training seconds, one panel per rate).

Every system here is synchronous and exact, so all of them follow one curve per step: the
steps to the target are expected to agree across systems, and the times to differ by the step
times alone; the record shows whether they do.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import compare
import records
from data_fetch import fetch_data

HERE = Path(__file__).resolve().parent
SYSTEMS = ["hybrid", "ps", "allreduce", "ddp-sparse", "torchrec-rw"]
NMT_HELD_OUT = 1024  # verse pairs held out of the NMT's training (validation: the first ones)
# per workload: target loss, validation samples (windows or pairs), samples per worker batch
DEFAULTS = {"lm": {"target": 6.88, "validation_windows": 256, "batch": 16},
            "nmt": {"target": 5.1, "validation_windows": 512, "batch": 32}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=sorted(DEFAULTS), default="lm")
    parser.add_argument("--machines", type=int, default=2)
    parser.add_argument("--nproc-per-machine", type=int, default=2)
    parser.add_argument("--rates", nargs="+", default=["1gbit", "100mbit"],
                        help="emulated link rates (tc syntax)")
    parser.add_argument("--systems", nargs="+", default=SYSTEMS, choices=compare.ALL_SYSTEMS)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                        help="initial weights and data order")
    parser.add_argument("--target", type=float, default=None,
                        help="validation loss (nats per word, full softmax) to reach "
                             "(default: lm 6.88, nmt 5.1)")
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--max-steps", type=int, default=500)
    parser.add_argument("--validation-windows", type=int, default=None,
                        help="held-out samples scored per evaluation: LM windows (default "
                             f"256) or NMT pairs (default 512, at most {NMT_HELD_OUT})")
    parser.add_argument("--batch", type=int, default=None,
                        help="samples per worker and step (default: lm 16, nmt 32)")
    parser.add_argument("--name", default=None,
                        help="output name (default time-to-quality-<workload>-<M>x<K>)")
    parser.add_argument("--out-dir", type=Path, default=records.scratch())
    args = parser.parse_args(argv)
    for key, value in DEFAULTS[args.workload].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.name is None:
        args.name = f"time-to-quality-{args.workload}-{args.machines}x{args.nproc_per_machine}"
    if args.eval_every < 1 or args.max_steps < 1:
        parser.error("--eval-every and --max-steps must be >= 1")
    return args


def compare_args(args: argparse.Namespace, rate: str, seed: int) -> argparse.Namespace:
    """compare.py's arguments for one launch of the workload at ``rate`` with ``seed``."""
    return compare.parse_args(["--workload", args.workload, "--machines", str(args.machines),
                               "--nproc-per-machine", str(args.nproc_per_machine),
                               "--rate", rate, "--batch", str(args.batch), "--isolate",
                               "--workload-options",
                               json.dumps({**workload_options(args.workload), "seed": seed})])


def workload_options(workload: str) -> dict:
    """What gives the workload its validation set: the KJV corpus, or held-out NMT pairs."""
    return {"corpus": "kjv"} if workload == "lm" else {"held_out": NMT_HELD_OUT}


def run(args: argparse.Namespace) -> dict:
    quality = {"target": args.target, "eval_every": args.eval_every,
               "max_steps": args.max_steps, "windows": args.validation_windows}
    fetch_data(args.workload, workload_options(args.workload))  # namespaces are offline
    runs = []
    total = len(args.rates) * len(args.seeds) * len(args.systems)
    with tempfile.TemporaryDirectory(prefix="ttq-") as tmp:
        for rate in args.rates:
            for round_, seed in enumerate(args.seeds):
                shift = round_ % len(args.systems)
                for system in args.systems[shift:] + args.systems[:shift]:
                    print(f"[ttq] run {len(runs) + 1}/{total}: {system}, {rate}, seed {seed}",
                          flush=True)
                    part = Path(tmp) / f"{len(runs)}.json"
                    record = {"system": system, "rate": rate, "seed": seed}
                    try:
                        compare.launch(compare_args(args, rate, seed), [system], part,
                                       extra={"quality": quality})
                        record.update(json.loads(part.read_text())[0])
                    except RuntimeError as error:  # recorded, not lost: the others go on
                        record["error"] = str(error)
                    runs.append(record)
    result = {"experiment": args.name, "provenance": compare.provenance(),
              "options": {k: str(v) if isinstance(v, Path) else v
                          for k, v in vars(args).items()},
              "shape": f"{args.machines}x{args.nproc_per_machine}", "runs": runs}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / f"{args.name}.json"
    out.write_text(json.dumps(result, indent=1))
    summary = markdown(result)
    out.with_suffix(".md").write_text(summary + "\n")
    print(summary, flush=True)
    plot(result, out.with_suffix(".png"))
    return result


def markdown(result: dict) -> str:
    """Per rate and system: steps and seconds to the target over the seeds (median, min–max)
    and each system's median time over the hybrid's."""
    options = result["options"]
    source = result["provenance"]
    held_out = ("held-out KJV windows" if options.get("workload", "lm") == "lm"
                else "held-out verse pairs")
    lines = [f"Time to a validation loss of {options['target']} (full softmax, "
             f"{options['validation_windows']} {held_out}), "
             f"{options.get('workload', 'lm').upper()} {result['shape']}, "
             f"batch {options['batch']}/worker, evaluated every {options['eval_every']} "
             f"steps; seeds {options['seeds']}; commit {(source.get('commit') or '?')[:10]}"
             + (" (uncommitted changes)" if source.get("dirty") else ""), "",
             "| rate | system | steps to target (per seed) | seconds to target, median "
             "(min–max) | s/step | this / hybrid (the hybrid's speed-up) |",
             "|---" * 6 + "|"]
    for rate in options["rates"]:
        rows = {s: [r for r in result["runs"] if r["rate"] == rate and r["system"] == s]
                for s in options["systems"]}
        hybrid = _median_seconds(rows.get("hybrid", []))
        for system, runs in rows.items():
            steps = ", ".join(str(r.get("steps_to_target") or
                                  ("error" if "error" in r else "not reached"))
                              for r in sorted(runs, key=lambda r: r["seed"]))
            times = [r["seconds_to_target"] for r in runs if r.get("seconds_to_target")]
            median = _median_seconds(runs)
            per_step = [r["step_s"] for r in runs if r.get("step_s")]
            seconds = f"{median:.1f} ({min(times):.1f}–{max(times):.1f})" if median else "–"
            step = f"{statistics.median(per_step) * 1e3:.0f} ms" if per_step else "–"
            ratio = f"{median / hybrid:.2f}x" if median and hybrid else "–"
            lines.append(f"| {rate} | {system} | {steps} | {seconds} | {step} | {ratio} |")
    return "\n".join(lines)


def _median_seconds(runs: list[dict]) -> float | None:
    times = [r["seconds_to_target"] for r in runs if r.get("seconds_to_target")]
    return statistics.median(times) if times else None


def plot(result: dict, path: Path) -> None:
    """Validation loss against training seconds, one panel per rate, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = result["options"]["rates"]
    fig, axes = plt.subplots(1, len(rates), figsize=(5.5 * len(rates), 3.8), squeeze=False)
    colours = {s: f"C{i}" for i, s in enumerate(result["options"]["systems"])}
    for ax, rate in zip(axes[0], rates, strict=True):
        for run in (r for r in result["runs"] if r["rate"] == rate and "curve" in r):
            curve = run["curve"]
            ax.plot([p["seconds"] for p in curve], [p["validation_loss"] for p in curve],
                    color=colours[run["system"]], alpha=0.8, lw=1,
                    label=run["system"] if run["seed"] == result["options"]["seeds"][0]
                    else None)
        ax.axhline(result["options"]["target"], color="grey", ls="--", lw=0.8)
        what = ("LM on KJV" if result["options"].get("workload", "lm") == "lm"
                else "NMT en-es")
        ax.set_title(f"{what}, {result['shape']}, {rate} (emulated)")
        ax.set_xlabel("training seconds")
        ax.set_ylabel("validation loss (full softmax)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def rewrite(path: Path) -> None:
    """The summary again from a run's JSON (``--from-json``)."""
    result = json.loads(path.read_text())
    path.with_suffix(".md").write_text(markdown(result) + "\n")
    print(markdown(result))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--from-json"]:
        rewrite(Path(sys.argv[2]))
        sys.exit(0)
    try:
        run(parse_args())
    except RuntimeError as error:
        sys.exit(str(error))
