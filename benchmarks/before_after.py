"""Step times of two commits in one sitting, interleaved: ``compare.py`` run from a checkout of
each commit, alternately, ``--rounds`` times (round r runs the *after* checkout first when r is
odd), one repeat and one launch per run. For a refactor that must not be slower: both commits
see the same host load, and every run is a fresh launch of the emulated cluster.

    python benchmarks/before_after.py --before /tmp/base --after . --out benchmarks/out/x.json -- \\
        --workload lm --machines 4 --nproc-per-machine 1 --rate 1gbit --systems hybrid

Everything after ``--`` goes to ``compare.py`` (``--isolate --repeats 1 --no-plot --out`` are
added). The record holds each run's compare record (commit, command, host) and, per side, the
median of the runs' median step times with their min and max; the table goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_side(checkout: Path, compare_args: list[str], out: Path) -> list[dict]:
    """One ``compare.py`` run from ``checkout`` (its own ``src`` on ``PYTHONPATH``)."""
    env = {**os.environ, "PYTHONPATH": str(checkout / "src")}
    command = [sys.executable, str(checkout / "benchmarks" / "compare.py"), *compare_args,
               "--isolate", "--repeats", "1", "--no-plot", "--out", str(out)]
    subprocess.run(command, check=True, env=env, cwd=checkout)
    return list(json.loads(out.read_text()))


def summary(runs: list[list[dict]]) -> dict[str, dict[str, float]]:
    """Per system: the median, min and max over the runs of each run's median step (s)."""
    by_system: dict[str, list[float]] = {}
    for records in runs:
        for record in records:
            by_system.setdefault(record["system"], []).append(record["median_step_s"])
    return {system: {"median_step_s": statistics.median(steps), "min_s": min(steps),
                     "max_s": max(steps), "runs": len(steps)}
            for system, steps in by_system.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="checkout of the old commit")
    parser.add_argument("--after", type=Path, required=True, help="checkout of the new commit")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True, help="the JSON record to write")
    args, compare_args = parser.parse_known_args()
    compare_args = [a for a in compare_args if a != "--"]
    sides = {"before": args.before.resolve(), "after": args.after.resolve()}
    runs: dict[str, list[list[dict]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="before-after-") as tmp:
        for round_ in range(args.rounds):
            order = ["after", "before"] if round_ % 2 else ["before", "after"]
            for side in order:
                print(f"[before_after] round {round_ + 1}/{args.rounds}: {side} "
                      f"({sides[side]})", flush=True)
                out = Path(tmp) / f"{side}-{round_}.json"
                runs[side].append(run_side(sides[side], compare_args, out))
    result = {"compare_args": compare_args, "rounds": args.rounds,
              "summary": {side: summary(runs[side]) for side in runs}, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print("| system | before: step (ms) | after: step (ms) | after / before |")
    print("|---|---|---|---|")
    for system, before in result["summary"]["before"].items():
        after = result["summary"]["after"][system]
        print(f"| {system} | {1e3 * before['median_step_s']:.1f} "
              f"({1e3 * before['min_s']:.1f}–{1e3 * before['max_s']:.1f}) | "
              f"{1e3 * after['median_step_s']:.1f} "
              f"({1e3 * after['min_s']:.1f}–{1e3 * after['max_s']:.1f}) | "
              f"{after['median_step_s'] / before['median_step_s']:.2f} |")


if __name__ == "__main__":
    main()
