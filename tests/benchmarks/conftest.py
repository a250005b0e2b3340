"""Fixtures shared by the benchmark workloads' tests."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist


@pytest.fixture
def gloo_group(tmp_path):
    """A single-process gloo group (a file store: no port to collide on)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1, timeout=timedelta(seconds=60))
    yield
    dist.destroy_process_group()
