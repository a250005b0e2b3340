"""Where the papers' regime begins (issue 37 item 4): inter-machine bytes per machine and step
on a GPU server's shape, 2 machines x 8 workers, measured on the emulated cluster for the
hybrid (local aggregation as the hybrid decides) and TorchRec row- and table-wise, turned
into step times at 10 and 100 Gbit/s by the fitted cost model with GPU-speed compute.

    python benchmarks/regime.py [--machines 2] [--nproc-per-machine 8] [--steps 4]
                                [--gpu-compute-ms 1.0] [--rates 10 100]

Measured: the wire bytes on each machine's link (``compare.py``, one launch per system, the
LM workload). Modelled, and so assumptions, said in the record: a step is
``t = c + β(r) · B`` with ``B`` the measured bytes per machine and step, ``β(r)`` the fitted
seconds per byte of ``benchmarks/results/extrapolation.json`` (1 Gbit/s, this host) scaled by
``1 Gbit/s / r``, and ``c`` the same compute for every system (``--gpu-compute-ms``: what a GPU
would take for the step's forward and backward; not measured here). Latency per collective
is left out (the optimistic side of ``extrapolate.py``'s two). Time on this host is CPU-bound
with 16 processes on 2 cores, so the measured step times are not reported as such.

Writes ``benchmarks/results/regime-<M>x<K>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import compare  # noqa: E402

SYSTEMS = ["hybrid", "torchrec-rw", "torchrec-tw"]


def modelled_ms(wire_bytes: float, rate_gbit: float, compute_ms: float,
                seconds_per_byte_1gbit: float) -> float:
    """``c + β(r) B`` in milliseconds (see the module)."""
    return compute_ms + seconds_per_byte_1gbit / rate_gbit * wire_bytes * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--machines", type=int, default=2)
    parser.add_argument("--nproc-per-machine", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--gpu-compute-ms", type=float, default=1.0)
    parser.add_argument("--rates", type=float, nargs="+", default=[10.0, 100.0])
    args = parser.parse_args()
    shape = f"{args.machines}x{args.nproc_per_machine}"
    out = HERE / "results" / f"regime-{shape}.json"
    runs = HERE / "results" / f"regime-{shape}-compare.json"
    subprocess.run([sys.executable, str(HERE / "compare.py"), "--workload", "lm",
                    "--machines", str(args.machines), "--nproc-per-machine",
                    str(args.nproc_per_machine), "--rate", "1gbit", "--systems", *SYSTEMS,
                    "--steps", str(args.steps), "--repeats", "1", "--isolate", "--no-plot",
                    "--out", str(runs)], check=True)
    records = {r["system"]: r for r in json.loads(runs.read_text()) if "unavailable" not in r}
    fit = json.loads((HERE / "results" / "extrapolation.json").read_text())["final_fit"]
    beta = fit["seconds_per_byte"]
    rows = []
    for system, record in records.items():
        wire = record["wire_bytes_per_machine_step"]
        rows.append({"system": system, "wire_bytes_per_machine_step": wire,
                     "engine_bytes_per_machine_step": record.get(
                         "engine_bytes_per_machine_step"),
                     "local_aggregation": record.get("local_aggregation"),
                     "modelled_step_ms": {f"{rate:g}gbit": modelled_ms(
                         wire, rate, args.gpu_compute_ms, beta) for rate in args.rates}})
    base = next(r for r in rows if r["system"] == "torchrec-rw")["wire_bytes_per_machine_step"]
    for row in rows:
        row["bytes_vs_torchrec_rw"] = row["wire_bytes_per_machine_step"] / base
    record = {**compare.provenance(), "shape": shape, "steps": args.steps,
              "assumptions": {"gpu_compute_ms": args.gpu_compute_ms,
                              "seconds_per_byte_1gbit": beta,
                              "model": "t = c + beta(1 Gbit/s) * (1 Gbit/s / r) * B; "
                                       "no per-collective latency"},
              "rows": rows}
    out.write_text(json.dumps(record, indent=1))
    lines = [f"{shape}, LM, wire bytes per machine and step (measured, emulated 1 Gbit/s) and "
             f"modelled step times (c = {args.gpu_compute_ms:g} ms, assumed)", "",
             "| system | wire B/machine/step | vs TorchRec row-wise | "
             + " | ".join(f"modelled step at {r:g} Gbit/s (ms)" for r in args.rates) + " |",
             "|---|---|---|" + "---|" * len(args.rates)]
    for row in rows:
        lines.append(f"| {row['system']} | {row['wire_bytes_per_machine_step']:,.0f} | "
                     f"{row['bytes_vs_torchrec_rw']:.2f}x | "
                     + " | ".join(f"{v:.2f}" for v in row["modelled_step_ms"].values()) + " |")
    text = "\n".join(lines)
    out.with_suffix(".md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
