"""``qsgd`` (Quant-DP): each rank's bucket quantised by QSGD's codec, the codes all-gathered,
every rank decoding all of them in rank order and summing: the same result on every rank, an
unbiased estimate of the AllReduced bucket.

A sum of quantised vectors is no quantised vector, so a ring AllReduce of codes is impossible;
like PyTorch's ``quantization_hooks``, this hook all-gathers. Each rank sends ``W-1`` encoded
payloads (gloo's ring all_gather): fewer bytes than the ring AllReduce's ``2 (W-1)/W`` of the
raw bucket only while ``W`` is below ``2 × (raw / encoded)`` (8-bit float32: W < ~8).
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations are real types.

import time

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket

from parallax.engine.dense_sync.state import DenseSyncState
from parallax.engine.diagnostics import phases

#: the name its bytes are counted under in `Runner.stats` (the codes mix the bucket's parameters)
TRAFFIC_NAME = "dense (qsgd)"


def qsgd_allgather(state: DenseSyncState, bucket: GradBucket,
                   ) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: quantise, all_gather the codes, decode and sum (then average)."""
    with phases.phase("dense sync"):
        began = time.perf_counter()
        codec, buffer = state.codec, bucket.buffer()
        assert codec is not None and state.generator is not None  # wrap_dense sets both
        payload = codec.encode(buffer, state.generator)
        state.traffic.record_ring_allgather(TRAFFIC_NAME, payload.numel())
        gathered = [torch.empty_like(payload) for _ in range(state.world)]
        dist.all_gather(gathered, payload)
        total = torch.zeros_like(buffer)
        for codes in gathered:
            total += codec.decode(codes, buffer.numel(), buffer.dtype)
        buffer.copy_(total)
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(state.finish(buffer))
        state.seconds += time.perf_counter() - began
    return done
