"""Tables 2 and 5 on a stable surface (issue 74, item 4): one server's sparse aggregation and
update time against the partition count P, with no network and many repeats; Eq. 1
(``t(P) = θ0 + θ1/P + θ2·P``) fitted to it; the papers' partition search run on the same surface
and scored against brute force's best and worst counts and against P = 1 (the paper's Min
column: the fewest partitions that fit in memory, which on this host is one).

    python benchmarks/partition_surface.py                     # the record's size
    python benchmarks/partition_surface.py --vocab 20000 --rounds 2 --steps 8 --counts 1 2 4

One process, a world of one (gloo): rank 0 is the only server and holds the table as the
engine holds any server table (`ShardedTable`, its partitions updated side by side on the
server's threads, `Config.server_threads`: this process's torch threads by default). A step
is what the server does with a step of ``--senders`` workers: each sender's lookup of its own
batch (ids drawn from a Zipf law, as words are), the backward through the pulled rows, then
the server's part, timed: the push (every sender's gradient rows received and summed per
partition) and the servers' optimizer (``--optimizer``, Adagrad as the papers' LM) over the
touched rows. Brute force times every count of ``--counts`` for ``--steps`` steps a round,
the counts in turn (the order reversed every other round) for ``--rounds`` rounds, each
round's first half of steps dropped; the search samples counts as the papers do (start at
the number of servers, double while faster, then halve), each sample ``--search-steps``
steps with the first half dropped (the papers': 100 and 50), then chooses from Eq. 1 fitted
to its samples.

Writes ``<scratch>/partition-surface-<name>.json`` (every round of every
count, the fitted θ and the search's samples); ``scripts/bench.sh partition-surface`` files
it as a record.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import records
import torch
import torch.distributed as dist

from parallax.cluster import WorkerInfo
from parallax.engine.optimizers.shard_optimizer import ShardOptimizer
from parallax.engine.tables.exchange import Traffic
from parallax.engine.tables.pool import PartitionPool, default_threads
from parallax.engine.tables.server_table import ShardedTable
from parallax.partitions.search import (
    Sample,
    fit_cost_model,
    search_partitions,
    second_half_mean,
)

OPTIMIZERS = {"adagrad": lambda params: torch.optim.Adagrad(params, lr=0.1),
              "sgd": lambda params: torch.optim.SGD(params, lr=0.1)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=200_000, help="the table's rows")
    parser.add_argument("--dim", type=int, default=128, help="the table's row width")
    parser.add_argument("--senders", type=int, default=4,
                        help="workers whose gradient rows the server sums each step")
    parser.add_argument("--tokens", type=int, default=2560,
                        help="ids per sender and step (the papers' LM: 128 x 20 words a GPU)")
    parser.add_argument("--zipf", type=float, default=1.1, help="the ids' Zipf exponent")
    parser.add_argument("--sparse", action=argparse.BooleanOptionalAction, default=True,
                        help="sparse gradients (nn.Embedding(sparse=True), TensorFlow's "
                        "IndexedSlices in the papers) or dense ones")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adagrad")
    parser.add_argument("--counts", type=int, nargs="+",
                        default=[1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64],
                        help="the partition counts brute force times (the search stays "
                        "within their range)")
    parser.add_argument("--steps", type=int, default=40,
                        help="steps per count and round, the first half dropped")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--search-steps", type=int, default=100,
                        help="steps per search sample, the first half dropped (the papers')")
    parser.add_argument("--threads", type=int, default=None,
                        help="the server's threads (Config.server_threads; default: this "
                        "process's torch threads)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="lm", help="the output's name")
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args(argv)


def zipf_ids(count: int, vocab: int, exponent: float, generator: torch.Generator) -> torch.Tensor:
    """``count`` ids in ``[0, vocab)`` drawn with probability ∝ 1 / (rank + 1)^exponent (id 0
    the most frequent), as word ids are."""
    weights = torch.arange(1, vocab + 1, dtype=torch.float64).pow(-exponent)
    return torch.multinomial(weights, count, replacement=True, generator=generator)


class Surface:
    """One table per partition count, each with its servers' optimizer, and the steps' ids."""

    def __init__(self, args: argparse.Namespace, group: dist.ProcessGroup, worker: WorkerInfo):
        self.args = args
        generator = torch.Generator().manual_seed(args.seed)
        weight = torch.randn(args.vocab, args.dim, generator=generator) * 0.1
        self.pool = PartitionPool(args.threads or default_threads())
        self.tables: dict[int, tuple[ShardedTable, ShardOptimizer]] = {}
        for count in sorted(set(args.counts)):
            param = torch.nn.Parameter(weight.clone())
            table = ShardedTable("emb", param.detach(), num_partitions=count, worker=worker,
                                 group=group, traffic=Traffic(0, worker.machine_of_rank),
                                 sparse_grad=args.sparse, average=False)
            table.pool = self.pool
            servers = ShardOptimizer([OPTIMIZERS[args.optimizer]([param])],
                                     {id(param): table}, self.pool)
            self.tables[count] = (table, servers)
        # a fixed cycle of batches, the same for every count
        self.batches = [[zipf_ids(args.tokens, args.vocab, args.zipf, generator)
                         for _ in range(args.senders)] for _ in range(8)]
        self.coefficient = torch.randn(args.tokens, args.dim, generator=generator)
        self.taken = 0

    def step(self, count: int) -> float:
        """One step on the table of ``count`` partitions; the server's seconds (push, sum and
        update)."""
        table, servers = self.tables[count]
        batch = self.batches[self.taken % len(self.batches)]
        self.taken += 1
        table.zero_grad()
        for ids in batch:  # each sender's lookup and backward
            rows, inverse = table.lookup(ids)
            (rows[inverse] * self.coefficient).sum().backward()
        begin = time.perf_counter()
        table.push_gradients()
        servers.step()
        return time.perf_counter() - begin

    def sample(self, count: int, steps: int) -> float:
        """Mean server seconds per step over the second half of ``steps`` steps."""
        return second_half_mean([self.step(count) for _ in range(steps)])


def brute_force(surface: Surface, counts: list[int], steps: int, rounds: int,
                progress: bool = True) -> dict[int, list[float]]:
    """Per count, each round's mean server seconds a step (the counts in turn, the order
    reversed every other round)."""
    seconds: dict[int, list[float]] = {count: [] for count in counts}
    for k in range(rounds):
        order = counts if k % 2 == 0 else counts[::-1]
        for count in order:
            seconds[count].append(surface.sample(count, steps))
        if progress:
            best = min(counts, key=lambda c: statistics.median(seconds[c]))
            print(f"partition_surface: round {k + 1}/{rounds}: best so far P = {best} "
                  f"({statistics.median(seconds[best]) * 1e3:.2f} ms)", file=sys.stderr,
                  flush=True)
    return seconds


def summary(seconds: dict[int, list[float]], chosen: int) -> dict[str, Any]:
    """Table 2's spread (worst over best) and Table 5's columns: the searched count's median
    over brute force's best (Optimal) and P = 1's over the searched (the Min column)."""
    medians = {count: statistics.median(values) for count, values in seconds.items()}
    best = min(medians, key=medians.__getitem__)
    worst = max(medians, key=medians.__getitem__)
    smallest = min(medians)
    return {"best": best, "worst": worst, "worst_over_best": medians[worst] / medians[best],
            "chosen": chosen, "chosen_over_best": medians[chosen] / medians[best],
            "min_over_chosen": medians[smallest] / medians[chosen], "min_count": smallest,
            "paired_chosen_over_best": [a / b for a, b in zip(seconds[chosen], seconds[best],
                                                              strict=True)],
            "paired_min_over_chosen": [a / b for a, b in zip(seconds[smallest], seconds[chosen],
                                                             strict=True)],
            "paired_worst_over_best": [a / b for a, b in zip(seconds[worst], seconds[best],
                                                             strict=True)]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    counts = sorted(set(args.counts))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        worker = WorkerInfo(rank=0, world_size=1, local_rank=0, machine=0, num_machines=1,
                            machine_of_rank=(0,))
        surface = Surface(args, dist.group.WORLD, worker)
        for count in counts:  # every table's first steps (state made, caches warm), untimed
            surface.sample(count, 4)
        seconds = brute_force(surface, counts, args.steps, args.rounds)
        began = time.perf_counter()
        search = search_partitions(lambda count: surface.sample(count, args.search_steps), 1,
                                   max_partitions=max(counts),
                                   min_partitions=min(counts))
        search_s = time.perf_counter() - began
        surface.pool.close()
    finally:
        dist.destroy_process_group()
    if search.partitions not in seconds:  # (a count brute force did not time: time it now)
        raise SystemExit(f"partition_surface: the search chose P = {search.partitions}, which "
                         f"--counts {counts} does not time: add it")
    medians = [Sample(count, statistics.median(values)) for count, values in seconds.items()]
    theta = fit_cost_model(medians)
    predicted = {c: theta[0] + theta[1] / c + theta[2] * c for c in counts}
    mean = statistics.fmean(s.seconds for s in medians)
    residual = sum((s.seconds - predicted[s.partitions]) ** 2 for s in medians)
    total = sum((s.seconds - mean) ** 2 for s in medians)
    return {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "threads": surface.pool.threads, "torch_threads": torch.get_num_threads(),
        "brute_force": [{"partitions": c, "seconds": seconds[c],
                         "median_step_s": statistics.median(seconds[c]),
                         "eq1_s": predicted[c]} for c in counts],
        "eq1": {"theta": theta, "r2": 1 - residual / total if total else None},
        "search": {"chosen": search.partitions, "theta": search.theta, "seconds": search_s,
                   "samples": [{"partitions": s.partitions, "seconds": s.seconds}
                               for s in search.samples]},
        "verdict": summary(seconds, search.partitions),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(args)
    out = args.out or records.scratch()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"partition-surface-{args.name}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    verdict = result["verdict"]
    print("| P | server ms/step (median of rounds) | Eq. 1 |")
    print("|---|---|---|")
    for row in result["brute_force"]:
        print(f"| {row['partitions']} | {row['median_step_s'] * 1e3:.3f} | "
              f"{row['eq1_s'] * 1e3:.3f} |")
    print(f"best P = {verdict['best']}, worst P = {verdict['worst']} "
          f"(worst / best {verdict['worst_over_best']:.2f}x); search chose P = "
          f"{verdict['chosen']} in {len(result['search']['samples'])} samples "
          f"(its step over the best {verdict['chosen_over_best']:.3f}; P = "
          f"{verdict['min_count']} over it {verdict['min_over_chosen']:.2f}x); Eq. 1 "
          f"R^2 = {result['eq1']['r2']:.3f}; wrote {path}")


if __name__ == "__main__":
    main()
