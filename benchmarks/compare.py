"""Systems side by side on the emulated cluster: parallax's four architectures against PyTorch
DDP (dense-gradient and sparse-gradient embeddings) and TorchRec, on one workload.

    python benchmarks/compare.py --machines 2 --nproc-per-machine 2 --rate 1gbit
    python benchmarks/compare.py --workload lm --seq-len 80 --vocab 10000 --isolate

writes benchmarks/out/compare-<workload>-<machines>x<workers>-<rate>.json (a list, one
record per system), a markdown table on stdout and, unless --no-plot, a PNG next to the JSON
(matplotlib: pip install -e '.[bench]'). Needs root and iproute2 (network namespaces, tc). The
network is emulated (tbf-limited veths, no delay), and all processes share this host's cores.

By default every system runs in turn inside one launch (one process group). With --isolate
each system gets its own `parallax run` launch (fresh processes, fresh namespaces): slower by
one launch per system (seconds), but no system's leftovers (memory the allocator kept, threads,
warm caches) touch the next one's time or memory.

``--repeats N`` (default 3) runs everything N times, the systems interleaved (round r runs
every system once, in an order rotated by r), so a slow spell of the shared host touches every
system alike. A record then holds each repeat's figures under ``repeats`` and, on top, the
median over repeats of their median step times (``median_step_s``, ``items_per_s``), its
``repeat_min_step_s``/``repeat_max_step_s``, the median wire bytes and the largest peak RSS.
Every record also names what produced it: ``provenance`` = commit (and whether the tree had
uncommitted changes), the exact command, host (CPU model, cores), torch and Python versions,
and the time it finished.

Each record (per system; "median" etc. over the timed steps, after the untimed warm-up):

* ``step_times_s``: the timed steps' times, each the mean over ranks of that step's time
  (all ranks wait for each other every step: they differ only by where each rank's clock
  starts); ``median_step_s``: their median; ``step_min_s``, ``step_p10_s``, ``step_p90_s``,
  ``step_max_s``: their spread (10th/90th percentile, interpolated: with few steps, read
  min/max). ``items_per_s``: world size x items per worker batch / median (``unit``: words or
  samples).
* ``wire_bytes_per_machine_step``: bytes sent + received on each machine's link (eth0 tx + rx
  counters of its namespace, over the timed steps; intra-machine traffic stays on loopback),
  averaged over machines, per step. Real wire bytes: payload plus TCP/IP/Ethernet headers,
  gloo's framing and the few small collectives (barrier) of the harness.
* ``peak_rss_mib``: peak resident memory of the worker process, max over ranks (MiB;
  ``peak_rss_mib_per_rank`` lists all). The count (VmHWM) is reset just before the system is
  built, so it covers building, warming up and timing this system; in a shared launch the
  baseline still includes what earlier systems left resident (``isolated`` says which).
  ``peak_rss_mib_per_machine``: the sum of a machine's workers' peaks, max over machines (an
  upper bound: the peaks need not coincide). ``predicted_rss_mib``: per rank, its resident
  memory just before the system was built plus what the memory model says it holds for
  training (`parallax.planning.memory`: parameters kept whole and own shards, their
  gradients, optimizer state, buffers; after the warm-up, when the plan is final), max over
  ranks (``predicted_rss_mib_per_rank`` lists all); None for TorchRec.
* ``cpu_ms_per_step_per_rank``: each rank's CPU time (user + system, every thread) per timed
  step; ``cpu_ms_per_step_by_thread``: the same split by thread, ``main`` (the training
  loop), ``gloo`` (the collectives' socket and work loops) and ``other``
  (`benchmarks/thread_cpu.py`). Where processes outnumber cores, the ranks' CPU time together
  bounds the step. With repeats: each repeat's under ``repeats``, on top the median over
  repeats rank by rank.
* parallax systems only, from ``runner.plan`` once α is measured (over the warm-up steps):
  ``alpha_model`` (element-weighted mean α, dense parameters count as 1), ``alphas`` (per
  sparse parameter), ``predicted_bytes_per_machine_step`` = ``plan.predicted_total(arch)``:
  the papers' Table 3 model for this engine (`parallax.planning.cost`), the *inter-machine*
  bytes sent +
  received per machine and step, averaged over machines, counting payloads (ids, rows, dense
  buckets through DDP's ring, count messages) and no protocol headers;
  ``engine_bytes_per_machine_step``: the same quantity counted by the engine over the timed
  steps (``runner.inter_machine_bytes()``); ``wire_over_predicted`` = wire bytes / predicted
  and ``engine_over_predicted`` = engine bytes / predicted (None on one machine, where nothing
  is predicted to cross). Both sides are per machine, per step, sent + received, inter-machine
  only: the wire ratio exceeds 1 by the protocol overhead and untracked traffic; the engine
  ratio tests the model's row counts (e.g. α_m of one step against the warm-up mean).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import records
from data_fetch import fetch_data

HERE = Path(__file__).resolve().parent
SYSTEMS = ["hybrid", "optps", "ps", "allreduce", "ddp-sparse", "ddp-dense"]
# Also: "hybrid-sparse" (and other "<architecture>-sparse"): the program with sparse=True
# embeddings under parallax; "hybrid-lazy": Config(lazy_sparse_updates=True); "hybrid-direct":
# Config(local_aggregation=False) (every worker exchanges with the servers itself);
# "hybrid-aggregated": Config(local_aggregation=True) (every machine's leader merges its rows,
# whatever the hybrid's rule would choose);
# "hybrid-late" / "ps-late": Config(overlap_push=False) (gradient rows pushed after the backward);
# "torchrec-rw" / "torchrec-tw": TorchRec, row- or table-wise (recsys, lm and nmt workloads);
# "torchrec-plan": TorchRec with each table's sharding chosen by its own planner;
# "plain": the single-device loop, no DDP (one worker only: parallax's single-worker overhead);
# "local" / "local-sparse": that loop on every worker at once, nothing exchanged (the step's
# no-exchange compute bound on this host; -sparse: sparse-gradient embeddings);
# "hybrid-plump" / "hybrid-qsgd" / "hybrid-slim" (and allreduce-*): that Config.dense_sync for
# the dense layers (Plump-DP through servers, Quant-DP, Slim-DP; SGD for plump and slim);
# "hybrid-flat": dense_sync="flat"; "hybrid-eager": the model built as the single-device program
# builds it, every table on every worker first (the others build it in parallax.meta_init());
# "hybrid-pooled": Config(pooled_tables=...) for the workload's long bags (the recommender's
# history: --workload-options '{"history": 32}'), pooled on their owners; "hybrid-rows":
# Config(pooled_tables=()), every table's rows pulled (by default the hybrid decides);
# "hybrid-tablewise": every EmbeddingBag table pooled on an owner (TorchRec's table-wise);
# "hybrid-byrows": the long bags pooled by rows (Config.pooled_by_rows: every server its rows'
# share, TorchRec's row-wise), the other bag tables table-wise; "hybrid-bycolumns": the long
# bags as column slices (Config.pooled_by_columns, TorchRec's column-wise), the other bag tables
# table-wise; "torchrec-cw": TorchRec column-wise on every table. Variants combine with "+"
# ("hybrid-aggregated+pooled": local aggregation for the rows, the long bags pooled).
ALL_SYSTEMS = [*SYSTEMS, "hybrid-sparse", "optps-sparse", "hybrid-lazy", "hybrid-direct",
               "hybrid-aggregated",
               "optps-direct", "hybrid-late", "ps-late", "torchrec-rw", "torchrec-tw",
               "torchrec-plan", "plain", "local", "local-sparse", "hybrid-plump", "hybrid-qsgd",
               "hybrid-slim",
               "hybrid-flat", "hybrid-eager", "hybrid-pooled", "hybrid-rows",
               "hybrid-tablewise", "hybrid-byrows", "hybrid-bycolumns", "torchrec-cw",
               # seed 001's cumulative ablation (issue 38 item 6): variants joined by "+"
               "ps-direct+rows", "hybrid-direct+rows", "hybrid-aggregated+rows",
               "hybrid-aggregated+pooled",
               # ... and on the LM and NMT with the operation placements (ablation.py):
               # "noopau": Config(after_aggregation="workers"), "noopsw": id_dedup="servers"
               "ps-direct+noopau+noopsw", "hybrid-direct+noopau+noopsw",
               "hybrid-aggregated+noopau+noopsw", "hybrid-aggregated+noopsw"]
WORKLOADS = ["lm", "nmt", "cnn", "recsys"]
DEFAULT_BATCH = {"lm": 16, "nmt": 32, "cnn": 64, "recsys": 256}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--machines", type=int, default=2)
    parser.add_argument("--nproc-per-machine", type=int, default=2)
    parser.add_argument("--rate", default="1gbit",
                        help="link rate (tc syntax); 'none': no emulated network (one "
                             "machine, or a host without network namespaces)")
    parser.add_argument("--systems", nargs="+", default=SYSTEMS, choices=ALL_SYSTEMS)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per system")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed steps per system (α is measured over them, up to 5)")
    parser.add_argument("--workload", choices=WORKLOADS, default="lm",
                        help="lm: LSTM + sampled softmax on a Zipf stream; nmt: translation "
                        "model (words); cnn: small ResNet on Fashion-MNIST (every parameter "
                        "dense); recsys: embeddings + MLP on MovieLens-100k (needs "
                        "benchmarks/setup_bench.sh)")
    parser.add_argument("--hash-multiplier", type=int, default=1,
                        help="recsys: table rows = ids x this (large, sparsely used tables)")
    parser.add_argument("--vocab", type=int, default=100_000, help="lm")
    parser.add_argument("--emb", type=int, default=128, help="lm")
    parser.add_argument("--hidden", type=int, default=128, help="lm")
    parser.add_argument("--seq-len", type=int, default=20, help="lm: words per sequence")
    parser.add_argument("--sampled", type=int, default=512,
                        help="lm: sampled negative classes per step")
    parser.add_argument("--batch", type=int,
                        help="per worker (default: " + ", ".join(
                            f"{w} {b}" for w, b in DEFAULT_BATCH.items()) + ")")
    parser.add_argument("--workload-options", type=json.loads, default={},
                        help="JSON object merged last into the workload's options, e.g. "
                        "'{\"vocab\": 8000}' for an option this script has no flag for")
    parser.add_argument("--isolate", action="store_true",
                        help="one launch per system (per-system memory, no interference)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="rounds of every system, interleaved (median and min-max shown)")
    parser.add_argument("--pin", action="store_true",
                        help="pin each worker to one of this host's cores (rank modulo the "
                        "cores): no process migrates between them mid-step")
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help="after the timed steps, 5 steps per system under torch.profiler: "
                        "DIR/<system>-rank<r>.txt (operators by self CPU time) and rank 0's "
                        "Chrome trace")
    parser.add_argument("--cpu-profile", type=Path, metavar="DIR",
                        help="after the timed steps, 50 steps per system under cProfile timed "
                        "by each thread's CPU time (waits on peers cost nothing): "
                        "DIR/<system>-rank<r>.prof and .txt (benchmarks/thread_cpu.py)")
    parser.add_argument("--out", type=Path, help="results JSON (default under benchmarks/out/)")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    if not isinstance(args.workload_options, dict):
        parser.error("--workload-options must be a JSON object")
    if args.steps < 1 or args.warmup < 0 or args.repeats < 1:
        parser.error("--steps and --repeats must be >= 1 and --warmup >= 0")
    return args


def workload_options(args: argparse.Namespace) -> dict:
    """The options dict `Workload(args.workload, options)` is built from."""
    batch = options_batch(args)
    if args.workload == "lm":
        options = {"vocab": args.vocab, "emb": args.emb, "hidden": args.hidden,
                   "seq_len": args.seq_len, "sampled": args.sampled, "batch": batch}
    elif args.workload == "recsys":
        options = {"emb": 32, "hidden": 64, "batch": batch,
                   "hash_multiplier": args.hash_multiplier}
    else:  # nmt, cnn
        options = {"batch": batch}
    return {**options, **args.workload_options}


def default_out(args: argparse.Namespace) -> Path:
    return records.scratch() / (f"compare-{args.workload}-{args.machines}x"
                               f"{args.nproc_per_machine}-{args.rate}.json")


def run(args: argparse.Namespace) -> list[dict]:
    """Run every system of ``args`` (see `parse_args`), write the JSON (and PNG), print the
    markdown table; returns the records. Raises RuntimeError when the workers fail."""
    out = args.out or default_out(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    fetch_data(args.workload, workload_options(args))  # workers in namespaces cannot download
    rounds: list[list[dict]] = []
    with tempfile.TemporaryDirectory(prefix="compare-") as tmp:
        for repeat in range(args.repeats):
            # rotated each round: no system always runs first (or right after another)
            order = args.systems[repeat % len(args.systems):] + \
                args.systems[:repeat % len(args.systems)]
            launches = [[system] for system in order] if args.isolate else [order]
            records = []
            for i, systems in enumerate(launches, 1):
                print(f"[compare] {args.workload} {args.machines}x{args.nproc_per_machine} "
                      f"{args.rate}: repeat {repeat + 1}/{args.repeats}, launch "
                      f"{i}/{len(launches)} ({' '.join(systems)})", flush=True)
                part = Path(tmp) / f"{repeat}-{i}.json"
                launch(args, systems, part)
                records += json.loads(part.read_text())
            rounds.append(sorted(records, key=lambda r: args.systems.index(r["system"])))
    results = [combine_repeats([records[i] for records in rounds])
               for i in range(len(args.systems))]
    source = provenance()
    for result in results:  # what ran, so each record stands on its own in an experiment
        result.update(workload=args.workload, rate=args.rate, pinned=args.pin,
                      nproc_per_machine=args.nproc_per_machine,
                      workload_options=workload_options(args), provenance=source)
    out.write_text(json.dumps(results, indent=1))
    print(markdown(results, args), flush=True)
    if not args.no_plot:
        plot(results, out.with_suffix(".png"), args)
    return results


def combine_repeats(records: list[dict]) -> dict:
    """One system's records of every repeat as one: the first's fields, each repeat's
    figures under ``repeats``, and the median over repeats on top (see the docstring)."""
    if any("unavailable" in r for r in records):
        return next(r for r in records if "unavailable" in r)
    if len(records) == 1:
        return records[0]
    medians = [r["median_step_s"] for r in records]
    combined = dict(records[0])
    combined["repeats"] = [{k: r.get(k) for k in REPEAT_FIELDS} for r in records]
    combined["median_step_s"] = statistics.median(medians)
    combined["repeat_min_step_s"], combined["repeat_max_step_s"] = min(medians), max(medians)
    combined["items_per_s"] = (records[0]["items_per_s"] * records[0]["median_step_s"]
                               / combined["median_step_s"])
    combined["wire_bytes_per_machine_step"] = statistics.median(
        r["wire_bytes_per_machine_step"] for r in records)
    for key in ("peak_rss_mib", "peak_rss_mib_per_machine"):
        combined[key] = max(r[key] for r in records)
    if all("cpu_ms_per_step_by_thread" in r for r in records):  # rank by rank, the median
        combined["cpu_ms_per_step_per_rank"] = _median_by_rank(
            [r["cpu_ms_per_step_per_rank"] for r in records])
        combined["cpu_ms_per_step_by_thread"] = {
            kind: _median_by_rank([r["cpu_ms_per_step_by_thread"][kind] for r in records])
            for kind in records[0]["cpu_ms_per_step_by_thread"]}
    del combined["step_times_s"]  # per repeat, under "repeats"
    return combined


def _median_by_rank(rows: list[list[float]]) -> list[float]:
    """Per rank, the median over repeats of its value."""
    return [round(statistics.median(values), 2) for values in zip(*rows, strict=True)]


REPEAT_FIELDS = ("median_step_s", "items_per_s", "step_times_s", "step_p10_s", "step_p90_s",
                 "wire_bytes_per_machine_step", "peak_rss_mib", "peak_rss_mib_per_machine",
                 "predicted_rss_mib", "engine_bytes_per_machine_step", "alpha_model", "loss_last",
                 "cpu_ms_per_step_per_rank", "cpu_ms_per_step_by_thread")


def provenance() -> dict:
    """What produced a result (``records.provenance``: commit, tree state and diff hash,
    command, host with its load, versions, time)."""
    return records.provenance()


def launch(args: argparse.Namespace, systems: list[str], out: Path,
           extra: dict | None = None) -> None:
    """One `parallax run` of compare_worker.py over ``systems``, writing ``out``; ``extra``:
    more worker arguments (``quality``: time_to_quality.py's training to a target)."""
    worker_args = {"systems": systems, "steps": args.steps, "warmup": args.warmup,
                   "out": str(out.resolve()), "workload_name": args.workload,
                   "workload": workload_options(args), "isolated": args.isolate,
                   "pin": args.pin,
                   "profile_dir": str(args.profile.resolve()) if args.profile else None,
                   "cpu_profile_dir": (str(args.cpu_profile.resolve()) if args.cpu_profile
                                       else None),
                   **(extra or {})}
    cmd = [sys.executable, "-m", "parallax.cli", "run", "--machines", str(args.machines),
           "--nproc-per-machine", str(args.nproc_per_machine),
           *(["--emulate-network", args.rate] if args.rate != "none" else []),
           str(HERE / "compare_worker.py"), json.dumps(worker_args)]
    out.unlink(missing_ok=True)
    proc = subprocess.run(cmd)
    if proc.returncode == 0:
        return
    if complete(out, systems):
        # Rank 0 writes the results only after every rank took part in the last system's
        # final reduction, so they are whole: the failure came during teardown (gloo has
        # been seen to abort a worker at exit, rarely). Keep them, say so.
        print(f"compare: warning: a worker failed at exit (status {proc.returncode}) after "
              f"all results were recorded ({' '.join(systems)}); results kept",
              file=sys.stderr, flush=True)
        return
    raise RuntimeError(
        f"compare: the workers failed (exit status {proc.returncode}) running "
        f"{' '.join(systems)} on {args.workload}, {args.machines}x"
        f"{args.nproc_per_machine} at {args.rate}; their errors are printed above")


def complete(out: Path, systems: list[str]) -> bool:
    """Whether ``out`` holds one record per system, in order (a finished run's file)."""
    try:
        results = json.loads(out.read_text())
    except (OSError, ValueError):
        return False
    return [r.get("system") for r in results] == systems


def options_batch(args: argparse.Namespace) -> int:
    return args.batch or DEFAULT_BATCH[args.workload]


def describe(args: argparse.Namespace) -> str:
    """The workload in a few words, for titles."""
    return {"lm": f"LM vocab {args.vocab:,}, emb {args.emb}, hidden {args.hidden}, "
                  f"seq_len {args.seq_len}",
            "nmt": "NMT",
            "cnn": "small ResNet on Fashion-MNIST",
            "recsys": f"recommender on MovieLens-100k, tables x{args.hash_multiplier}"}[
                args.workload]


def fmt(value: float | None, spec: str = ",.0f", suffix: str = "") -> str:
    """``value`` formatted, or an en dash where there is none (DDP has no plan)."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return f"{value:{spec}}{suffix}"


HEADER = ("| system | step (ms, median) | {spread} (ms) | {unit}/s | vs {base} | "
          "wire bytes/machine/step | predicted (Table 3) | wire/predicted | α_model | "
          "peak RSS/worker (MiB) | predicted/worker (MiB) | peak RSS/machine (MiB) |")


def markdown(results: list[dict], args: argparse.Namespace) -> str:
    done = [r for r in results if "unavailable" not in r]
    if not done:
        return "no system could run: " + "; ".join(r["unavailable"] for r in results)
    base = next((r for r in done if r["system"] in ("ddp-dense", "plain")), done[-1])
    unit = done[0]["unit"]
    repeats = len(done[0].get("repeats", [])) or 1
    source = done[0].get("provenance") or {}
    commit = (source.get("commit") or "?")[:10] + (" (uncommitted changes)"
                                                   if source.get("dirty") else "")
    lines = [f"{args.machines} machines x {args.nproc_per_machine} workers, {args.rate} "
             f"(emulated), {describe(args)}, batch {options_batch(args)}/worker, "
             f"{args.warmup} warm-up + {args.steps} timed steps"
             f"{', one launch per system' if args.isolate else ''}"
             + (f", {repeats} interleaved repeats (median of their medians; spread: min–max)"
                if repeats > 1 else ", one run (spread: p10–p90 of the timed steps)")
             + f"; commit {commit}", "",
             HEADER.format(unit=unit, base=base["system"],
                           spread="repeats min–max" if repeats > 1 else "step p10–p90"),
             "|---" * 12 + "|"]
    for r in results:
        if "unavailable" in r:
            lines.append(f"| {r['system']} | unavailable: {r['unavailable']} |" + " |" * 10)
            continue
        low, high = ((r["repeat_min_step_s"], r["repeat_max_step_s"]) if "repeats" in r
                     else (r["step_p10_s"], r["step_p90_s"]))
        lines.append(
            f"| {r['system']} | {1e3 * r['median_step_s']:.0f} | "
            f"{1e3 * low:.0f}–{1e3 * high:.0f} | "
            f"{r['items_per_s']:,.0f} | {r['items_per_s'] / base['items_per_s']:.2f}x | "
            f"{r['wire_bytes_per_machine_step']:,.0f} | "
            f"{fmt(r.get('predicted_bytes_per_machine_step'))} | "
            f"{fmt(r.get('wire_over_predicted'), '.2f')} | {fmt(r.get('alpha_model'), '.3f')} | "
            f"{r['peak_rss_mib']:,.0f} | {fmt(r.get('predicted_rss_mib'))} | "
            f"{fmt(r.get('peak_rss_mib_per_machine'))} |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path, args: argparse.Namespace) -> None:
    """Throughput per system; the whiskers: the repeats' min–max (one run: the p10–p90 step
    times), as throughput."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in results if "unavailable" not in r]
    if not done:
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    items = [r["items_per_s"] * r["median_step_s"] for r in done]  # per cluster step
    heights = [r["items_per_s"] for r in done]
    slow = [r.get("repeat_max_step_s", r["step_p90_s"]) for r in done]
    fast = [r.get("repeat_min_step_s", r["step_p10_s"]) for r in done]
    low = [h - n / t for h, n, t in zip(heights, items, slow, strict=True)]
    high = [n / t - h for h, n, t in zip(heights, items, fast, strict=True)]
    ax.bar([r["system"] for r in done], heights,
           yerr=[[max(v, 0) for v in low], [max(v, 0) for v in high]], capsize=3)
    ax.set_ylabel(f"{done[0]['unit']}/s")
    ax.set_title(f"{args.workload.upper()}, {args.machines}x{args.nproc_per_machine} workers, "
                 f"{args.rate} (emulated)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    try:
        run(parse_args())
    except RuntimeError as error:
        sys.exit(str(error))
