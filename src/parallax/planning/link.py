"""The inter-machine link the plan's predicted times assume: bytes per machine and step
(`parallax.planning.cost`) become seconds at the link's rate.

The rate is given (`Config.link_gbit`: Gbit/s each way, full duplex) or measured once, after
the warm-up, by timed all_to_alls in which every rank sends the same number of bytes to every
rank on other machines (nothing to its own machine's): the cost model's accounting exactly,
bytes sent plus received across machines per machine, so a predicted time is the predicted
bytes divided by the rate. The probe is small: five collectives, `PROBE_BYTES` per machine
in each timed call (about 8 ms at 1 Gbit/s). Its rate is a whole call's, the collective's
fixed cost included as in a step's exchange of that size: 0.84-0.85 of an emulated 1 Gbit/s
link on 2 machines x 2 workers, and once 1.09 (tc's token bucket lets a call's first 250 kB each
way leave at once: `tests/integration/test_netem.py` allows up to that burst's share). The fixed
cost alone (an empty call's time) is reported beside the rate, not added per parameter,
whose collectives are shared with the other tables of a step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallax.cluster import WorkerInfo
from parallax.engine.tables.exchange import all_to_all

__all__ = ["Link", "given", "measure"]

#: bytes sent plus received across machines, per machine, in one probe call
PROBE_BYTES = 2_000_000
#: timed probe calls (after one untimed), back to back; the slowest rank's mean counts
PROBE_CALLS = 2


@dataclass(frozen=True)
class Link:
    """``bytes_per_s``: bytes crossing machines per machine and second, sent plus received
    (a full-duplex link of R bytes/s each way: 2R); ``latency_s``: an empty all_to_all's
    time (None when the rate is given); ``source``: where the rate comes from."""

    bytes_per_s: float
    source: str
    latency_s: float | None = None

    def seconds(self, bytes_per_step: float | None) -> float | None:
        """The link time of ``bytes_per_step`` bytes per machine (None stays None)."""
        return None if bytes_per_step is None else bytes_per_step / self.bytes_per_s

    def describe(self) -> str:
        each_way = self.bytes_per_s / 2 * 8 / 1e9
        latency = ("" if self.latency_s is None
                   else f"; an empty exchange {self.latency_s * 1e3:.2f} ms")
        return f"link {each_way:.3g} Gbit/s each way ({self.source}{latency})"


def given(gbit_each_way: float) -> Link:
    """A full-duplex link of ``gbit_each_way`` Gbit/s (`Config.link_gbit`)."""
    return Link(bytes_per_s=2 * gbit_each_way * 1e9 / 8, source="Config.link_gbit")


def measure(worker: WorkerInfo, group: dist.ProcessGroup) -> Link | None:
    """Time the link between the machines (collective over ``group``, every rank calls it;
    the same answer on every rank: the slowest rank's times decide). None on one machine."""
    ranks = worker.machine_of_rank
    mine = worker.machine
    remote = [r for r, m in enumerate(ranks) if m != mine]
    if not remote:
        return None
    k = ranks.count(mine)
    # per machine: its k ranks send `size` to each remote rank and receive as much
    size = max(1, PROBE_BYTES // (2 * k * len(remote)))
    splits = [0 if m == mine else size for m in ranks]
    device = worker.device
    message = torch.zeros(sum(splits), dtype=torch.uint8, device=device)
    out = torch.empty_like(message)
    empty = torch.empty(0, dtype=torch.uint8, device=device)
    nothing = [0] * len(ranks)

    def clock() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    # no barriers: each all_to_all waits for its peers, so the calls after the first (which
    # also sets up connections and buffers) start together on every rank
    all_to_all(out, message, splits, splits, group=group)
    start = clock()
    all_to_all(empty, empty, nothing, nothing, group=group)
    middle = clock()
    for _ in range(PROBE_CALLS):
        all_to_all(out, message, splits, splits, group=group)
    seconds = torch.tensor([(clock() - middle) / PROBE_CALLS, middle - start],
                           dtype=torch.float64, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=group)
    full, latency = seconds.tolist()
    per_machine = 2 * k * len(remote) * size
    # one call's whole time, its fixed cost included: what a step's exchange of that size
    # takes (the fixed cost alone, reported, is not added per parameter)
    return Link(bytes_per_s=per_machine / full,
                source=f"measured: {per_machine / 1e6:.1f} MB probe", latency_s=latency)
