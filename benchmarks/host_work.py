"""Host work per step: the benchmark LM (`workloads.SampledSoftmaxLM`, Adagrad) trained by a
plain PyTorch loop (DDP over it with ``--workers N``) and by the same loop after
``parallax.distribute`` (one worker: rank 0 is the only server; N workers: the DDP port,
``distribute(DDP(model), optimizer)``), or with ``--door runner`` by ``parallax.get_runner``'s
``Runner.step`` (one worker: its tables replicated after the warm-up), counted and timed on
this host's CPU.

    python benchmarks/host_work.py [--vocab 2000] [--emb 16] [--steps 300] [--rounds 3]
                                   [--workers 1] [--device cpu] [--door distribute]
                                   [--trace TRACE.json] [--out benchmarks/out/host_work.json]

``--workers N`` (N > 1) starts N workers on this machine with ``parallax run`` (gloo, no
emulated link) and counts every rank; the record gives each rank's counts and, per system,
the largest over ranks (``systems``), with the collectives per step (``c10d::`` operators
the profiler records: all_gather, all_to_all, all_reduce, ...).

``--torchrec`` (several workers) adds TorchRec on the same program and batches: the LM's
two tables in one ``EmbeddingCollection`` sharded row-wise, its fused Adagrad, DDP over the
LSTM (`TorchRecStep`).

Counted (deterministic, what the engine asks of the host each step): the ``aten::`` operators,
the collectives and the bytes handed to them (each one's sent input, whole:
`sent_by_collectives`) that torch.profiler records, and the Python function calls
``cProfile`` records, each per step over 50 steps. Timed: the mean step of ``--steps`` steps,
the systems in turn (the order reversed every other round) for ``--rounds`` rounds (medians
and ranges; one process on a shared host, so read the ratio, and only beside the counts).
Small sizes by default: the engine's own work, not the model's arithmetic, is what is measured, as
on a GPU where the model's kernels are fast and the host issues them (issue 41: the one-worker
step's host work). With ``--device cuda`` the model and batches live on the GPU, each timed round
ends with ``torch.cuda.synchronize()``, and the counts add the kernel launches and the host's waits
on the device (stream and device synchronisations) per step, from the profiler's CUDA runtime
events. ``--trace FILE`` writes the parallax system's counted steps as a Chrome trace with Python
frames, for ``benchmarks/profile_callers.py`` (which lines make the host wait). ``--extra-tables
K`` adds K input tables alike to the embedding (`WideInputLM`): the step's cost per table, and
whether its collectives grow with the tables (`scripts/host_tables.sh`). """

from __future__ import annotations

import argparse
import cProfile
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import profile

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import compare  # noqa: E402
import records  # noqa: E402
from workloads import LMConfig, SampledSoftmaxLM, sampled_softmax_loss, zipf_lm_batch  # noqa: E402

import parallax  # noqa: E402
from parallax.step.forward import to_device  # noqa: E402

COUNTED_STEPS = 50
# untimed steps first: the sparsity warm-up, the local-aggregation trial (8 + 8 steps at
# several workers) and the plan's completion all end before the counted steps begin
WARMUP_STEPS = 30
AGGREGATION = {"trial": None, "on": True, "off": False}


class TorchRecStep:
    """TorchRec's row-wise LM (`torchrec_lm.make_torchrec_lm_step`: its tables in one
    ``EmbeddingCollection`` sharded row-wise, fused Adagrad in the backward, DDP over the LSTM)
    as a system here: ``step(batch)`` trains one batch."""

    def __init__(self, cfg: LMConfig) -> None:
        from torchrec_lm import make_torchrec_lm_step

        self.step = make_torchrec_lm_step("torchrec-rw", cfg, optimizer="adagrad", lr=0.1)
        self.model = self.step.model


def train(model, optimizer, batches) -> None:
    """The plain loop, or the own loop after ``distribute``; ``optimizer`` None: ``model``
    is a `parallax.Runner` (the ``--door runner`` program), stepped by ``Runner.step``, or
    a `TorchRecStep`."""
    if optimizer is None:
        for batch in batches:
            model.step(batch)
        return
    for inputs, targets in batches:
        optimizer.zero_grad()
        sampled_softmax_loss(model(*inputs), targets).backward()
        optimizer.step()


def device_of(model) -> torch.device:
    module = model.model if isinstance(model, (parallax.Runner, TorchRecStep)) else model
    return next(module.parameters()).device


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_ms(model, optimizer, batches) -> float:
    device = device_of(model)
    synchronize(device)
    start = time.perf_counter()
    train(model, optimizer, batches)
    synchronize(device)
    return (time.perf_counter() - start) / len(batches) * 1e3


# CUDA runtime calls that make the host wait for the device, and that launch a kernel.
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")


#: per collective the profiler records, the input it sends (the others: its output, options)
SENT_INPUT = {"c10d::allreduce_": 0, "c10d::alltoall_base_": 1, "c10d::alltoall_": 1,
              "c10d::_allgather_base_": 1, "c10d::allgather_": 1, "c10d::broadcast_": 0,
              "c10d::_reduce_scatter_base_": 1, "c10d::reduce_scatter_": 1,
              "c10d::reduce_": 0, "c10d::gather_": 1, "c10d::scatter_": 1, "c10d::send": 0,
              "c10d::barrier": None, "c10d::monitored_barrier_": None}
#: bytes per element of the dtypes the profiler names (C++ type names)
ITEM_BYTES = {"float": 4, "double": 8, "int": 4, "long int": 8, "c10::Half": 2,
              "c10::BFloat16": 2, "bool": 1, "unsigned char": 1, "signed char": 1,
              "short int": 2}


def sent_by_collectives(events) -> tuple[int, int]:
    """``(bytes, elements of tensor lists)`` the profiled collectives were handed to send:
    each one's sent input whole (an all_to_all's whole send buffer, its own share
    included). A tensor list's dtype is not in the profiler's record: its elements are
    returned apart (the caller knows what they are)."""
    sent = listed = 0
    for event in events:
        if not event.name.startswith("c10d::"):
            continue
        if event.name not in SENT_INPUT:
            raise SystemExit(f"host_work: collective {event.name} has no entry in SENT_INPUT "
                             f"(which of its inputs is sent): add it")
        index = SENT_INPUT[event.name]
        if index is None:
            continue
        shape, dtype = event.structured_input_shapes[index], event.input_dtypes[index]
        if dtype == "TensorList":
            listed += sum(math.prod(dims) for dims in shape)
        elif dtype in ITEM_BYTES:
            sent += math.prod(shape) * ITEM_BYTES[dtype]
        else:
            raise SystemExit(f"host_work: {event.name} sends a {dtype!r} tensor, whose size "
                             f"ITEM_BYTES does not know: add it")
    return sent, listed


def counts(model, optimizer, batches, trace: Path | None = None) -> dict[str, float]:
    """``aten::`` operators, collectives and the bytes handed to them, and Python function
    calls, per step (and the trace, if asked). Tensor-list collectives (DDP's gradient
    buckets) are counted at 4 bytes an element: every such list of these programs' steps is
    float32 gradients (``list_elements_per_step`` says how many elements that was)."""
    with profile(with_stack=trace is not None, record_shapes=True) as prof:
        train(model, optimizer, batches)
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    events = prof.key_averages()
    aten = sum(e.count for e in events if e.key.startswith("aten::"))
    collectives = sum(e.count for e in events if e.key.startswith("c10d::"))
    waits = sum(e.count for e in events if e.key in WAITS)
    launches = sum(e.count for e in events if e.key in LAUNCHES)
    sent, listed = sent_by_collectives(prof.events())
    calls = cProfile.Profile()
    calls.runcall(train, model, optimizer, batches)
    python = sum(entry.callcount for entry in calls.getstats())
    return {"aten_ops_per_step": aten / len(batches),
            "python_calls_per_step": python / len(batches),
            "collectives_per_step": collectives / len(batches),
            "collective_bytes_per_step": (sent + 4 * listed) / len(batches),
            "list_elements_per_step": listed / len(batches),
            "kernel_launches_per_step": launches / len(batches),
            "device_waits_per_step": waits / len(batches)}


class WideInputLM(SampledSoftmaxLM):
    """The benchmark LM with ``extra`` more input tables (``--extra-tables``), each of the
    embedding's shape and read with the same tokens, their rows added to the embedding's: the
    same program with more tables alike, to count what each table costs."""

    def __init__(self, cfg: LMConfig, extra: int):
        super().__init__(cfg)
        self.extra = torch.nn.ModuleList(torch.nn.Embedding(cfg.vocab, cfg.emb)
                                         for _ in range(extra))

    def forward(self, tokens, candidates):
        embedded = self.embedding(tokens)
        for table in self.extra:
            embedded = embedded + table(tokens)
        hidden = self.lstm(embedded)[0].reshape(-1, self.hidden_size)
        return hidden @ self.softmax(candidates).t()


def build(name: str, args: argparse.Namespace, cfg: LMConfig, device: torch.device,
          world: int):
    """One system: ``plain`` (DDP over the model at several workers), ``parallax`` or
    ``torchrec`` (`TorchRecStep`)."""
    torch.manual_seed(0)
    if name == "torchrec":
        return TorchRecStep(cfg), None
    extra = getattr(args, "extra_tables", 0)
    model = (WideInputLM(cfg, extra) if extra else SampledSoftmaxLM(cfg)).to(device)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)
    config = parallax.Config(partition_cache=None, num_partitions=args.partitions,
                             overlap_push=not args.no_overlap_push,
                             local_aggregation=AGGREGATION[args.local_aggregation],
                             alpha_threshold=0.0 if getattr(args, "replicate", False) else None)
    door = args.door
    if name == "parallax" and door == "runner":
        return parallax.get_runner(model, optimizer, sampled_softmax_loss, config=config), None
    if world > 1:
        model = DistributedDataParallel(model)
    if name == "parallax":
        return parallax.distribute(model, optimizer, config=config)
    return model, optimizer


def measure(args: argparse.Namespace, device: torch.device, world: int) -> dict:
    """Every system's counts and step times on this rank."""
    cfg = LMConfig(vocab=args.vocab, emb=args.emb, hidden=args.emb, seq_len=5, batch=4,
                   sampled=16)
    rank = dist.get_rank() if world > 1 else 0
    generator = torch.Generator().manual_seed(1 + rank)
    batches = [to_device(zipf_lm_batch(cfg, generator), device) for _ in range(args.steps)]
    systems = {}
    for name in ("plain", "parallax", *(("torchrec",) if args.torchrec else ())):
        model, optimizer = build(name, args, cfg, device, world)
        train(model, optimizer, batches[:WARMUP_STEPS])  # the plan settles in parallax's
        systems[name] = (model, optimizer)
    counted = {}
    for name, (model, optimizer) in systems.items():
        trace = args.trace if name == "parallax" and rank == 0 else None
        counted[name] = counts(model, optimizer, batches[:COUNTED_STEPS], trace)
    times: dict[str, list[float]] = {name: [] for name in systems}
    for round_ in range(args.rounds):
        order = list(systems) if round_ % 2 == 0 else list(reversed(systems))
        for name in order:
            times[name].append(step_ms(*systems[name], batches))
    for name, measured in times.items():
        counted[name].update(step_ms_median=statistics.median(measured),
                             step_ms_rounds=measured)
    return counted


def largest(per_rank: list[dict]) -> dict:
    """Per system and count, the largest over ranks (the step waits for the slowest)."""
    return {name: {key: max(rank[name][key] for rank in per_rank) if key != "step_ms_rounds"
                   else per_rank[0][name][key] for key in per_rank[0][name]}
            for name in per_rank[0]}


def launch(args: argparse.Namespace) -> None:
    """Start ``--workers`` workers of this script with ``parallax run`` (one machine)."""
    cmd = [sys.executable, "-m", "parallax.cli", "run", "--machines", "1",
           "--nproc-per-machine", str(args.workers), str(Path(__file__).resolve()),
           *sys.argv[1:]]
    if subprocess.run(cmd).returncode != 0:
        raise SystemExit(f"host_work: the {args.workers} workers failed (their errors above)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=2000)
    parser.add_argument("--emb", type=int, default=16)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=1,
                        help="workers on this machine (more than one: parallax run, gloo)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (one GPU)")
    parser.add_argument("--door", choices=("distribute", "runner"), default="distribute",
                        help="parallax's own loop (distribute: tables on the servers), or "
                             "Runner.step (get_runner: one worker replicates its tables)")
    parser.add_argument("--partitions", type=int, default=None,
                        help="Config.num_partitions (default: the partition search's choice, "
                             "which follows timings: pin it for counts that are the same on "
                             "every run)")
    parser.add_argument("--local-aggregation", choices=tuple(AGGREGATION), default="trial",
                        help="Config.local_aggregation at several workers: the default "
                             "times the leader hop in a trial (pin it for counts that are "
                             "the same on every run)")
    parser.add_argument("--no-overlap-push", action="store_true",
                        help="Config(overlap_push=False): Runner.step pushes after the "
                             "backward (its early push groups tables by measured arrival)")
    parser.add_argument("--extra-tables", type=int, default=0,
                        help="input tables beside the LM's two, alike (what each table "
                             "costs: scripts/host_tables.sh)")
    parser.add_argument("--replicate", action="store_true",
                        help="Config(alpha_threshold=0): the hybrid moves every table to "
                             "AllReduce after the warm-up (what a table the plan replicates "
                             "costs: scripts/host_replicated.sh)")
    parser.add_argument("--torchrec", action="store_true",
                        help="also TorchRec's row-wise LM on the same batches (several "
                             "workers, the benchmark LM only): its counts beside DDP's")
    parser.add_argument("--trace", type=Path, default=None,
                        help="write parallax's counted steps as a Chrome trace here")
    parser.add_argument("--out", type=Path, default=records.scratch() / "host_work.json")
    args = parser.parse_args()
    if args.workers > 1 and "RANK" not in os.environ:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        launch(args)
        return
    if args.torchrec and (args.workers < 2 or args.extra_tables or args.device != "cpu"):
        parser.error("--torchrec: several --workers, the benchmark LM (no --extra-tables), "
                     "on CPU (TorchRecStep shards over gloo)")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible to this process")
    torch.set_num_threads(1)
    world = args.workers
    if world > 1:
        dist.init_process_group("gloo")
    mine = measure(args, device, world)
    per_rank = [mine]
    if world > 1:
        gathered: list = [None] * world
        dist.all_gather_object(gathered, mine)
        per_rank = gathered
    parallax.shutdown()
    if world > 1:
        if dist.is_initialized():  # shutdown leaves a group the program made to it
            dist.destroy_process_group()
        if int(os.environ["RANK"]) != 0:
            return
    settings = vars(args) | {"out": str(args.out), "trace": str(args.trace)}
    record: dict = {"settings": settings, "systems": largest(per_rank), "ranks": per_rank}
    ours = record["systems"]["parallax"]
    for peer in ("plain", "torchrec"):
        if peer in record["systems"]:
            theirs = record["systems"][peer]
            record[f"parallax_over_{peer}"] = {key: ours[key] / theirs[key] for key in (
                "aten_ops_per_step", "python_calls_per_step", "step_ms_median")}
    record["provenance"] = compare.provenance()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    print(f"device: {device}, {world} worker(s), door {args.door} (largest over ranks)")
    print("| system | aten ops/step | Python calls/step | collectives/step | bytes to "
          "collectives/step | kernel launches/step | device waits/step | step (ms, median of "
          "rounds) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, row in record["systems"].items():
        print(f"| {name} | {row['aten_ops_per_step']:.0f} | {row['python_calls_per_step']:.0f} "
              f"| {row['collectives_per_step']:.0f} | {row['collective_bytes_per_step']:.0f} "
              f"| {row['kernel_launches_per_step']:.0f} | {row['device_waits_per_step']:.1f} "
              f"| {row['step_ms_median']:.2f} ({min(row['step_ms_rounds']):.2f}–"
              f"{max(row['step_ms_rounds']):.2f}) |")


if __name__ == "__main__":
    main()
