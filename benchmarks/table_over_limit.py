"""A table about twice what one worker process may hold trains under parallax; under plain
DDP the same program runs out of memory.

Every worker process gets the same limit on its private writable memory (``RLIMIT_DATA``,
set by the worker itself: heap and anonymous mappings, what a tensor's storage takes). The
model: one ``nn.Embedding(rows, dim, sparse=True)`` of ``ratio x limit`` bytes and a linear
head, SGD. parallax builds it in ``parallax.meta_init`` and each of the ``machines`` servers
makes and holds its shard (``1 / machines`` of the table); DDP builds the whole table in every
worker.

    python benchmarks/table_over_limit.py --limit-mib 1280 --ratio 2 --machines 4 [--rate 1gbit]

prints one row per system (exit status, peak RSS per worker, the cause of a failure).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import compare
import records

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "benchmarks" / "table_over_limit_worker.py"


@dataclass
class Outcome:
    system: str
    returncode: int
    ranks: list[dict]
    output: str

    @property
    def out_of_memory(self) -> bool:
        return "can't allocate memory" in self.output or "MemoryError" in self.output

    def row(self) -> str:
        if self.returncode == 0:
            peaks = [r["peak_rss_mib"] for r in self.ranks]
            exported = [r.get("peak_rss_mib_after_export") for r in self.ranks]
            after = ("-" if None in exported else
                     f"{max(exported):,.0f} (ranks: {', '.join(f'{p:,.0f}' for p in exported)})")
            return (f"| {self.system} | trained {len(self.ranks[0]['losses'])} steps | "
                    f"{max(peaks):,.0f} (ranks: {', '.join(f'{p:,.0f}' for p in peaks)}) | "
                    f"{after} |")
        cause = "out of memory" if self.out_of_memory else f"exit {self.returncode}"
        return f"| {self.system} | failed: {cause} | - | - |"


def run(system: str, *, limit_mib: int, ratio: float, machines: int, dim: int,
        steps: int, out_dir: Path | None = None, rate: str | None = None,
        timeout: float = 600) -> Outcome:
    """Train under ``system``; the workers' records (and parallax's exported model.pt) go to
    ``out_dir`` (a temporary directory when None). ``rate``: each machine in its own network
    namespace with a link of that rate (``parallax run --emulate-network``; needs root)."""
    limit = limit_mib * 2**20
    rows = table_rows(limit_mib, ratio, dim)
    with tempfile.TemporaryDirectory() as scratch:
        where = Path(out_dir or scratch)
        cmd = [sys.executable, "-m", "parallax.cli", "run", "--machines", str(machines),
               "--nproc-per-machine", "1",
               *(["--emulate-network", rate] if rate else []),
               str(WORKER), system, str(limit), str(rows), str(dim), str(steps), str(where)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        ranks = sorted((json.loads(p.read_text()) for p in where.glob("rank*.json")),
                       key=lambda r: r["rank"])
    return Outcome(system, proc.returncode, ranks, proc.stdout + proc.stderr)


def table_rows(limit_mib: int, ratio: float, dim: int) -> int:
    return int(ratio * limit_mib * 2**20 / (dim * 4))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit-mib", type=int, default=1280)
    parser.add_argument("--ratio", type=float, default=2.0, help="table bytes / limit")
    parser.add_argument("--machines", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rate", help="emulated link rate per machine, e.g. 1gbit (root)")
    args = parser.parse_args()
    table_mib = args.ratio * args.limit_mib
    network = f"emulated {args.rate} links" if args.rate else "loopback"
    print(f"limit per worker process (RLIMIT_DATA): {args.limit_mib} MiB; table "
          f"{table_mib:,.0f} MiB ({args.ratio}x); {args.machines} machines x 1 worker, "
          f"{network}\n")
    print("| system | result | peak RSS per worker, MiB | ... and after export, MiB |\n"
          "|---|---|---|---|")
    rows = []
    for system in ("parallax", "ddp"):
        outcome = run(system, limit_mib=args.limit_mib, ratio=args.ratio,
                      machines=args.machines, dim=args.dim, steps=args.steps, rate=args.rate)
        rows.append(outcome.row())
        print(rows[-1], flush=True)
    out = records.scratch() / "table_over_limit.json"
    out.write_text(json.dumps({"options": vars(args), "table_mib": table_mib, "rows": rows,
                               "provenance": compare.provenance()}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
