"""``flat``: one ring AllReduce over all ranks per bucket, as DDP's default hook does.

Every rank sends ``2 w (W-1) / W`` bytes of a ``w``-byte bucket; with ``k`` workers per machine
the ring leaves and enters each machine once, ``4 w (W-1) / W`` on its link against
``hierarchical``'s ``4 w (N-1) / N`` (the plan predicts it so: `parallax.planning.cost`).
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations are real types.

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket

from parallax.engine.dense_sync.state import DenseSyncState
from parallax.errors import InternalError


def flat_allreduce(state: DenseSyncState, bucket: GradBucket,
                   ) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: asynchronous AllReduce of the bucket; bytes counted per parameter."""
    for name, payload in state.payloads(bucket):
        state.traffic.record_ring_allreduce(name, payload)
    work = dist.all_reduce(bucket.buffer(), async_op=True)
    if work is None:  # (async_op=True always gives a Work)
        raise InternalError("all_reduce(async_op=True) returned no work")
    summed: torch.futures.Future[torch.Tensor] = work.get_future().then(
        lambda done: state.finish(done.value()[0]))
    return summed
