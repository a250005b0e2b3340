"""How many partitions a sparse table should have: sample a few counts, fit, pick the minimum.

More partitions spread a table's aggregation and update work over more parallel pieces but add
per-partition overhead; the papers model an iteration's time as
``t(P) = θ0 + θ1 / P + θ2 · P`` and find a near-optimal ``P`` from a handful of samples:

1. start at ``P = number of servers``; double while the time improves;
2. then halve from the start while the time improves;
3. fit ``θ`` by least squares over the samples and choose the integer ``P`` inside the sampled
   range where the fitted curve is lowest (with fewer than three samples, the fastest one);
   among counts that spread partitions evenly over the servers (see `sampling`).

`search_partitions` does only this arithmetic: what a sample costs (re-partitioning the tables
and timing a few steps) is the caller's ``measure``, so the search is tested with an injected
clock. `time_steps` is the measurement the papers use: run K steps, discard the first half.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass

import numpy as np

from parallax.errors import ArgumentError

__all__ = ["Sample", "SearchResult", "fit_cost_model", "sampling", "search_partitions",
           "second_half_mean", "time_steps"]


@dataclass(frozen=True)
class Sample:
    partitions: int
    seconds: float  # time per iteration


@dataclass(frozen=True)
class SearchResult:
    """The chosen count, the samples in the order taken, and the fitted ``(θ0, θ1, θ2)``
    (None when there were fewer than three distinct counts to fit)."""

    partitions: int
    samples: tuple[Sample, ...]
    theta: tuple[float, float, float] | None

    def predicted_seconds(self, partitions: int) -> float | None:
        if self.theta is None:
            return None
        t0, t1, t2 = self.theta
        return t0 + t1 / partitions + t2 * partitions


def fit_cost_model(samples: list[Sample]) -> tuple[float, float, float]:
    """Least-squares ``(θ0, θ1, θ2)`` of ``t(P) = θ0 + θ1/P + θ2·P`` over ``samples``."""
    p = np.array([s.partitions for s in samples], dtype=np.float64)
    t = np.array([s.seconds for s in samples], dtype=np.float64)
    design = np.stack([np.ones_like(p), 1.0 / p, p], axis=1)
    theta, *_ = np.linalg.lstsq(design, t, rcond=None)
    return float(theta[0]), float(theta[1]), float(theta[2])


def sampling(start: int, *, max_partitions: int, min_partitions: int = 1, balance: int = 1,
             ) -> Generator[int, float, SearchResult]:
    """The search as a generator, for callers that time training steps as they come: it yields
    the next count to sample, is sent that count's seconds per iteration, and returns the
    `SearchResult`. ``start`` is usually the number of servers; counts stay within
    ``[min_partitions, max_partitions]`` (e.g. at most the table's rows).

    ``balance`` (the number of servers) restricts the fitted choice to multiples of it, and to
    the sampled counts: partition ``p`` lives on server ``p % S``, so any other count gives
    some servers one partition more than others, and the slowest server sets every step's
    pace, which the smooth model cannot see (P=3 on 2 servers ran slower than both P=2 and
    P=4: the partition records)."""
    if not min_partitions <= start <= max_partitions:
        raise ArgumentError(f"start={start} must lie in [min_partitions={min_partitions}, "
                         f"max_partitions={max_partitions}]")
    taken: list[Sample] = []
    seconds: dict[int, float] = {}

    def record(partitions: int, measured: float) -> float:
        seconds[partitions] = float(measured)
        taken.append(Sample(partitions, seconds[partitions]))
        return seconds[partitions]

    record(start, (yield start))
    current = start
    while current * 2 <= max_partitions and record(current * 2,
                                                   (yield current * 2)) < seconds[current]:
        current *= 2
    current = start
    while current // 2 >= min_partitions and record(current // 2,
                                                    (yield current // 2)) < seconds[current]:
        current //= 2
    if len(seconds) < 3:
        best = min(seconds, key=seconds.__getitem__)
        return SearchResult(best, tuple(taken), None)
    theta = fit_cost_model(taken)
    low, high = min(seconds), max(seconds)
    counts = [p for p in range(low, high + 1) if p % balance == 0 or p in seconds]
    candidates = np.array(counts, dtype=np.float64)
    fitted = theta[0] + theta[1] / candidates + theta[2] * candidates
    return SearchResult(int(candidates[int(np.argmin(fitted))]), tuple(taken), theta)


def search_partitions(measure: Callable[[int], float], start: int, *,
                      max_partitions: int, min_partitions: int = 1,
                      balance: int = 1) -> SearchResult:
    """Sample ``measure(P)`` (seconds per iteration with ``P`` partitions) as the papers do and
    choose ``P`` (see `sampling`)."""
    search = sampling(start, max_partitions=max_partitions, min_partitions=min_partitions,
                      balance=balance)
    partitions = next(search)
    while True:
        try:
            partitions = search.send(measure(partitions))
        except StopIteration as done:
            result: SearchResult = done.value
            return result


def second_half_mean(durations: list[float]) -> float:
    """Mean of the second half of a sample's step durations: the first half warms caches and
    connections after a re-partition."""
    kept = durations[len(durations) // 2:]
    return sum(kept) / len(kept)


def time_steps(step: Callable[[], object], iterations: int,
               clock: Callable[[], float] = time.perf_counter) -> float:
    """Mean seconds per call of ``step`` over the second half of ``iterations`` calls (the
    first half warms caches and connections after a re-partition)."""
    if iterations < 2:
        raise ArgumentError(f"iterations must be at least 2 (half are discarded), got {iterations}")
    durations = []
    for _ in range(iterations):
        begin = clock()
        step()
        durations.append(clock() - begin)
    return second_half_mean(durations)
