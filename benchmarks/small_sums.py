"""What one sum over all ranks costs, per scheme and payload size, on the emulated cluster:
the measurement behind `parallax.engine.tables.reduction` (which sums small payloads by one
all_to_all) and `parallax.engine.tables.reservations` (which saves a pull's count message).

    python benchmarks/small_sums.py [--machines 2] [--nproc-per-machine 2] [--rate 1gbit]
                                    [--calls 100] [--repeats 3] [--sizes 16 10000 ...]

Each repeat is one ``parallax run`` of ``small_sums_worker.py``: every scheme in turn, per
size, ``--calls`` calls after a warm-up; CPU time is the process's (all threads: gloo's too)
and both are averaged over the ranks. Medians over the repeats (which interleave the
schemes). Writes ``benchmarks/out/small_sums-<M>x<K>-<rate>.json`` (raw records, commit,
host) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import compare  # noqa: E402
import records  # noqa: E402

SIZES = [16, 10_000, 30_000, 100_000, 300_000]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--machines", type=int, default=2)
    parser.add_argument("--nproc-per-machine", type=int, default=2)
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes", type=int, nargs="+", default=SIZES)
    args = parser.parse_args()
    runs = []
    for repeat in range(args.repeats):
        with tempfile.TemporaryDirectory() as folder:
            out = Path(folder) / "sums.json"
            cmd = [sys.executable, "-m", "parallax.cli", "run", "--machines",
                   str(args.machines), "--nproc-per-machine", str(args.nproc_per_machine),
                   "--emulate-network", args.rate, str(HERE / "small_sums_worker.py"),
                   str(out), str(args.calls), *map(str, args.sizes)]
            subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1800)
            runs.append(json.loads(out.read_text()))
            print(f"small_sums: repeat {repeat + 1}/{args.repeats} done", flush=True)
    table = []
    for i, first in enumerate(runs[0]):
        table.append({**{k: first[k] for k in ("float32s", "scheme")},
                      "cpu_ms": statistics.median(run[i]["cpu_ms"] for run in runs),
                      "wall_ms": statistics.median(run[i]["wall_ms"] for run in runs),
                      "wall_ms_range": [min(run[i]["wall_ms"] for run in runs),
                                        max(run[i]["wall_ms"] for run in runs)]})
    name = f"small_sums-{args.machines}x{args.nproc_per_machine}-{args.rate}.json"
    record = {"command": " ".join(sys.argv), **compare.provenance(), "repeats": args.repeats,
              "calls": args.calls, "table": table, "raw": runs}
    (records.scratch() / name).write_text(json.dumps(record, indent=1))
    print(f"{args.machines} machines x {args.nproc_per_machine} workers, {args.rate} "
          f"(emulated), {args.calls} calls x {args.repeats} repeats; per call and rank\n")
    print("| payload (float32s) | scheme | CPU (ms) | wall (ms, median) | wall range |")
    print("|---|---|---|---|---|")
    for row in table:
        low, high = row["wall_ms_range"]
        print(f"| {row['float32s']:,} | {row['scheme']} | {row['cpu_ms']:.2f} | "
              f"{row['wall_ms']:.2f} | {low:.2f}–{high:.2f} |")


if __name__ == "__main__":
    main()
