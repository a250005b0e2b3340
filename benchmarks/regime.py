"""Where the papers' regime begins (issue 37 item 4): inter-machine bytes per machine and step
on a GPU server's shape, 2 machines x 8 workers, measured on the emulated cluster for the
hybrid (local aggregation as the hybrid decides) and TorchRec row- and table-wise, turned
into step times at 10 and 100 Gbit/s by the fitted cost model with GPU-speed compute.

    python benchmarks/regime.py [--machines 2] [--nproc-per-machine 8] [--steps 4]
                                [--gpu-compute-ms 1.0] [--rates 10 100]

Measured: the wire bytes on each machine's link (``compare.py``, one launch per system, the
LM workload). Modelled, and so assumptions, said in the record: a step is
``t = c + β(r) · B`` with ``B`` the measured bytes per machine and step, ``β(r)`` the fitted
seconds per byte of the newest extrapolation record (1 Gbit/s, this host) scaled by
``1 Gbit/s / r``, and ``c`` the same compute for every system (``--gpu-compute-ms``: what a GPU
would take for the step's forward and backward; not measured here). Latency per collective
is left out (the optimistic side of ``extrapolate.py``'s two). Time on this host is CPU-bound
with 16 processes on 2 cores, so the measured step times are not reported as such.

Beside them, the **floor** of any exact exchange of float32 rows (`exchange_floor`), from the
same workers' batches (the seeds of ``compare_worker.data_seed``): each row a machine reads
from another machine's server comes in once and its gradient goes back once; a row's home is
either fixed before the step and spread evenly over the machines (``id % machines``: the
engine's round-robin partitions spread rows as evenly, so the same count in expectation)
or, as a bound no placement can beat, the best home for that very step (one reader of a
shared row pays, a row read by one machine costs nothing); the dense gradient costs a
ring AllReduce's ``2 (M-1)/M`` of its size each way. Ids, headers and TCP/IP are left out, so
the floor is below anything a wire can carry. ``--floor-only`` recomputes it against the last
record without launching anything.

Writes ``benchmarks/out/regime-<M>x<K>.json`` and ``.md``.
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
import records  # noqa: E402
import torch  # noqa: E402
from compare_worker import data_seed  # noqa: E402
from workloads import SampledSoftmaxLM, Workload, zipf_lm_batch  # noqa: E402

SYSTEMS = ["hybrid", "torchrec-rw", "torchrec-tw"]


def modelled_ms(wire_bytes: float, rate_gbit: float, compute_ms: float,
                seconds_per_byte_1gbit: float) -> float:
    """``c + β(r) B`` in milliseconds (see the module)."""
    return compute_ms + seconds_per_byte_1gbit / rate_gbit * wire_bytes * 1e3


def exchange_floor(machines: int, per_machine: int, steps: int, seed: int = 0) -> dict:
    """Payload bytes per machine and step that an exact exchange cannot go below (module
    docstring), averaged over ``steps`` steps of the LM's default batches."""
    workload = Workload("lm", {"seed": seed})  # the workers' own batches (`data_seed`)
    cfg = workload.cfg
    with torch.device("meta"):  # (its sizes only: no 100 MB of tables)
        model = SampledSoftmaxLM(cfg)
    row_bytes = [model.embedding.weight[0].nbytes, model.softmax.weight[0].nbytes]
    dense = sum(p.nbytes for p in model.lstm.parameters())
    generators = [torch.Generator().manual_seed(data_seed(workload, rank))
                  for rank in range(machines * per_machine)]
    engine_home = any_home = 0.0
    for _ in range(steps):
        batches = [zipf_lm_batch(cfg, g)[0] for g in generators]
        for table in range(2):  # 0: the input embedding (tokens), 1: the softmax (candidates)
            read = [torch.unique(torch.cat([batches[m * per_machine + k][table].reshape(-1)
                                            for k in range(per_machine)]))
                    for m in range(machines)]
            readers = torch.bincount(torch.cat(read))
            # a row read from another machine: in once, its gradient out once, each counted
            # on both links (sent + received per machine is what the wire counters add up)
            engine_home += 4 * row_bytes[table] * sum(int((ids % machines != m).sum())
                                                      for m, ids in enumerate(read))
            any_home += 4 * row_bytes[table] * int((readers - 1).clamp(min=0).sum())
    ring = 2 * 2 * (machines - 1) / machines * dense
    per = steps * machines
    return {"row_bytes": row_bytes, "dense_bytes": dense, "dense_ring_bytes": ring,
            "rows_engine_home": engine_home / per, "rows_any_home": any_home / per,
            "floor_engine_home": engine_home / per + ring, "floor_any_home": any_home / per + ring,
            "steps": steps, "ids_headers_tcp": "left out"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--machines", type=int, default=2)
    parser.add_argument("--nproc-per-machine", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--gpu-compute-ms", type=float, default=1.0)
    parser.add_argument("--rates", type=float, nargs="+", default=[10.0, 100.0])
    parser.add_argument("--floor-only", action="store_true",
                        help="no launch: the floor against the last record of this shape")
    args = parser.parse_args()
    shape = f"{args.machines}x{args.nproc_per_machine}"
    out = records.scratch() / f"regime-{shape}.json"
    runs = records.scratch() / f"regime-{shape}-compare.json"
    if not args.floor_only:
        subprocess.run([sys.executable, str(HERE / "compare.py"), "--workload", "lm",
                        "--machines", str(args.machines), "--nproc-per-machine",
                        str(args.nproc_per_machine), "--rate", "1gbit", "--systems",
                        *SYSTEMS,
                        "--steps", str(args.steps), "--repeats", "1", "--isolate",
                        "--no-plot", "--out", str(runs)], check=True)
    by_system = {r["system"]: r for r in json.loads(runs.read_text()) if "unavailable" not in r}
    fit = records.read(records.newest("extrapolation"))["final_fit"]
    beta = fit["seconds_per_byte"]
    rows = []
    for system, record in by_system.items():
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
    floor = exchange_floor(args.machines, args.nproc_per_machine, args.steps + 3)
    hybrid = next((r for r in rows if r["system"] == "hybrid"), None)
    if hybrid is not None and hybrid["engine_bytes_per_machine_step"]:
        floor["hybrid_engine_over_floor"] = (hybrid["engine_bytes_per_machine_step"]
                                             / floor["floor_engine_home"])
    floor["floor_engine_home_vs_torchrec_rw"] = floor["floor_engine_home"] / base
    floor["floor_any_home_vs_torchrec_rw"] = floor["floor_any_home"] / base
    measured = compare.provenance()
    if args.floor_only and out.exists():  # the rows were measured then: keep what made them
        earlier = json.loads(out.read_text())
        measured = {key: earlier[key] for key in ("commit", "dirty", "command", "host",
                                                  "finished") if key in earlier}
        floor["computed_by"] = compare.provenance()
    record = {**measured, "shape": shape, "steps": args.steps,
              "assumptions": {"gpu_compute_ms": args.gpu_compute_ms,
                              "seconds_per_byte_1gbit": beta,
                              "model": "t = c + beta(1 Gbit/s) * (1 Gbit/s / r) * B; "
                                       "no per-collective latency"},
              "rows": rows, "exact_exchange_floor": floor}
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
    lines += ["", "Floor of any exact exchange of float32 rows (payload; ids, headers and TCP/IP "
              "left out), B/machine/step:", "",
              "| home of a row | rows | dense ring | floor | vs TorchRec row-wise's wire |",
              "|---|---|---|---|---|"]
    for home in ("engine_home", "any_home"):
        where = "fixed, spread evenly" if home == "engine_home" else "best for the step"
        lines.append(f"| {where} | {floor['rows_' + home]:,.0f} | "
                     f"{floor['dense_ring_bytes']:,.0f} | {floor['floor_' + home]:,.0f} | "
                     f"{floor[f'floor_{home}_vs_torchrec_rw']:.3f}x |")
    text = "\n".join(lines)
    out.with_suffix(".md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
