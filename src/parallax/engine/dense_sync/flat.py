"""``flat``: one ring AllReduce over all ranks per bucket, as DDP's default hook does.

Every rank sends ``2 w (W-1) / W`` bytes of a ``w``-byte bucket; with ``k`` workers per machine
the ring crosses machines as often as ranks do, so machine links carry more than under
``hierarchical`` (the plan's byte predictions assume ``hierarchical``).
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations are real types.

import torch
import torch.distributed as dist

from parallax.engine.dense_sync.state import DenseSyncState


def flat_allreduce(state: DenseSyncState, bucket: dist.GradBucket,
                   ) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: asynchronous AllReduce of the bucket; bytes counted per parameter."""
    for name, piece in state.pieces(bucket):
        state.traffic.record_ring_allreduce(name, piece.numel() * piece.element_size())
    work = dist.all_reduce(bucket.buffer(), async_op=True)
    return work.get_future().then(lambda done: state.finish(done.value()[0]))
