"""``hierarchical`` (default): each bucket reduced inside the machine, AllReduced among the
machines' leaders, broadcast back (`parallax.engine.tables.hierarchy`): Table 3's ``4 w (N-1) / N``
bytes on each machine's link, which the plan predicts. When all dense gradients together are
small, each bucket is summed by one all_to_all instead (`parallax.engine.tables.reduction`: there
three collectives cost more than the bytes; chosen once for the model, as the plan predicts),
or, under `Runner.step`, left for the push to sum (`parallax.engine.dense_sync.deferred`).
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations are real types.

import time

import torch
from torch._C._distributed_c10d import GradBucket

from parallax.engine.dense_sync.state import DenseSyncState
from parallax.engine.diagnostics import phases
from parallax.engine.tables import reduction


def hierarchical_allreduce(state: DenseSyncState, bucket: GradBucket,
                           ) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: AllReduce the bucket machine by machine and count its bytes per
    parameter. The three collectives run before the hook returns: the backward waits for them
    (on CPU there is little compute to overlap with)."""
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    if state.deferring:  # summed in the push (`parallax.engine.dense_sync.deferred`)
        state.deferred = True
        done.set_result(bucket.buffer())
        return done
    with phases.phase("dense sync"):
        began = time.perf_counter()
        buffer = bucket.buffer()
        reduction.account_payloads(state.payloads(bucket), traffic=state.traffic,
                                   all_to_all=state.small_sums)
        reduction.all_reduce(buffer, all_to_all=state.small_sums)
        done.set_result(state.finish(buffer))
        state.seconds += time.perf_counter() - began
    return done
