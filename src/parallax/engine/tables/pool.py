"""A server's partitions processed in parallel: a thread pool of torch ops.

Torch releases the GIL inside its kernels, so a table split into more partitions lets a server
aggregate and update the partitions side by side on several cores; each partition also adds a
fixed cost (one more optimizer call, one more slice of the received rows). That is the trade-off
``t(P) = θ0 + θ1/P + θ2·P`` of `parallax.partitions.search` describes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from parallax.errors import ArgumentError

__all__ = ["PartitionPool", "close_shared_pools", "default_threads", "shared_pool"]


def default_threads() -> int:
    """Threads per server when `Config.server_threads` is None: this process's torch threads
    (``OMP_NUM_THREADS`` when set, which ``parallax run --emulate-network`` sizes to the host's
    cores), at least 1."""
    return max(1, min(torch.get_num_threads(), os.cpu_count() or 1))


class PartitionPool:
    """Runs one task per partition on up to ``threads`` threads; waits for all of them."""

    def __init__(self, threads: int = 1):
        if threads < 1:
            raise ArgumentError(f"threads must be at least 1, got {threads}")
        self.threads = threads
        self._executor = (ThreadPoolExecutor(threads, thread_name_prefix="parallax-partition")
                          if threads > 1 else None)

    def run(self, tasks: Sequence[Callable[[], object]]) -> None:
        """Call every task; re-raises the first task's exception after all have ended."""
        if self._executor is None or len(tasks) <= 1:
            for task in tasks:
                task()
            return
        futures = [self._executor.submit(task) for task in tasks]
        errors = [f.exception() for f in futures]  # waits for all: no task outlives the call
        for error in errors:
            if error is not None:
                raise error

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


SERIAL = PartitionPool(1)
_shared: dict[int, PartitionPool] = {1: SERIAL}


def shared_pool(threads: int) -> PartitionPool:
    """One pool per thread count and process: runners created one after another (a test
    matrix, a notebook) reuse its threads instead of leaving idle ones behind."""
    if threads not in _shared:
        _shared[threads] = PartitionPool(threads)
    return _shared[threads]


def close_shared_pools() -> None:
    """Join the shared pools' threads (`parallax.shutdown`): no torch op of a partition may
    still run while the process groups are destroyed."""
    for threads, pool in list(_shared.items()):
        if threads != 1:
            pool.close()
            del _shared[threads]
