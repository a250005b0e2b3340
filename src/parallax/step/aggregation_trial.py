"""Whether the leader hop pays, measured: the hybrid's local-aggregation choice by trial.

The bytes rule (`Hybrid.keeps_local_aggregation`) keeps the hop where merging a machine's rows
is predicted to save at least 20 % of the bytes. On the LM at 2 machines x 8 workers it kept a
hop that made the step slower for 20 % fewer bytes (records local-aggregation-lm-2x8-*): the
hop's cost is its serial order (the non-leaders idle while their leader exchanges), which bytes
do not show. So where the rule keeps it, after any partition search (whose samples ran with the
hop; not under ``parallax plan``), `AggregationTrial` times ``steps`` steps with the hop, then
``steps`` without, each sample the mean of its second half on the slowest rank (as the
partition search samples a count: every rank takes the same decision), and keeps the hop only
if it is faster by `KEEP_MARGIN`.
Training is unchanged either way: the same gradient rows are summed, in another order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from parallax.partitions.tuner import slowest_rank_mean

__all__ = ["AggregationTrial", "KEEP_MARGIN"]

# The hop is kept only where it is this much faster: a tie shows no benefit, and the direct
# exchange has fewer collectives: a trial that kept the hop on a tie was followed by a launch
# where the hop was much slower (record local-aggregation-lm-2x8-1gbit-margin).
KEEP_MARGIN = 0.03


class AggregationTrial:
    """Drives the trial from the plan keeper: `begin` once α is measured and the bytes rule
    kept the hop, then `after_step` with every step's seconds until `active` turns False;
    ``switch(on)`` turns the hop on or off between steps (collective decisions: every rank
    switches at the same step)."""

    def __init__(self, switch: Callable[[bool], None], *, steps: int,
                 group: dist.ProcessGroup | None, device: torch.device):
        self._switch = switch
        self._steps = steps
        self._group = group
        self._device = device
        self.active = False
        #: seconds per step with the hop (True) and without (False), once sampled
        self.samples: dict[bool, float] = {}
        self._durations: list[float] = []

    @property
    def keeps(self) -> bool:
        """The decision (valid once `active` is False after a `begin`): the hop at least
        `KEEP_MARGIN` faster."""
        return (self.samples.get(True, 0.0) * (1 + KEEP_MARGIN)
                <= self.samples.get(False, float("inf")))

    def begin(self) -> None:
        self.active, self._durations, self.samples = True, [], {}
        self._switch(True)

    def after_step(self, seconds: float) -> None:
        if not self.active:
            return
        self._durations.append(seconds)
        if len(self._durations) < self._steps:
            return
        with_hop = True not in self.samples  # the first sample is the hop's
        self.samples[with_hop] = slowest_rank_mean(self._durations, self._group, self._device)
        self._durations = []
        if with_hop:  # now without
            self._switch(False)
            return
        self.active = False
        self._switch(self.keeps)

    def summary(self) -> str:
        """The decision and its samples, for the plan."""
        with_hop, without = self.samples[True], self.samples[False]
        return (f"local aggregation {'kept' if self.keeps else 'off'} by trial: "
                f"{with_hop * 1e3:.1f} ms/step with the leader hop, {without * 1e3:.1f} without")
