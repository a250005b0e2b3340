"""Fixtures of the engine's unit tests: a one-rank gloo group in this process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist

from parallax.cluster import WorkerInfo


@pytest.fixture
def group() -> Iterator[dist.ProcessGroup]:
    """The default group of a world of one (gloo, in-memory store), destroyed afterwards."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.fixture
def worker() -> WorkerInfo:
    """Rank 0 of a one-machine, one-worker job: its own (and only) parameter server."""
    return WorkerInfo(rank=0, world_size=1, local_rank=0, machine=0, num_machines=1,
                      machine_of_rank=(0,))
