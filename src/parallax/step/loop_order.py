"""In the user's own loop (`parallax.distribute`), every rank must call forwards, optimizer
steps and exports in the same order. One small collective says where every rank is, so a rank
that skipped ``optimizer.step()`` (or ran one forward more) is named on every rank instead of
meeting a different collective. `Runner.step` needs no check (its order is fixed), nor do
workers whose steps are not aligned (asynchronous training).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import torch
import torch.distributed as dist

from parallax.cluster import WorkerInfo
from parallax.engine import process_group
from parallax.engine.diagnostics.progress import Explainer
from parallax.errors import UnevenInputsError, UnsupportedProgramError

__all__ = ["COLLECTIVE_EXPORT", "SOME_RANKS_EVALUATE", "VALUES", "Call", "LoopOrder"]

COLLECTIVE_EXPORT = (
    "model.state_dict() is collective (it gathers the servers' rows): call it on every rank "
    "and save on one, e.g. state = model.state_dict(); then if rank == 0: torch.save(state, "
    "path). The DDP habit of calling it on rank 0 alone cannot work here.")


class Call(enum.IntEnum):
    """What a rank is calling."""

    FORWARD = 1
    UPDATE = 2
    EXPORT = 3
    MEAN = 4
    EVALUATE = 5  # a forward without gradients
    LAYER = 6  # the program's own call of a table's layer (`parallax.model.loop_reads`)
    READ = 7  # the program's own read of a whole server-held parameter


_SAID = {Call.FORWARD: "a forward of the model", Call.UPDATE: "optimizer.step()",
         Call.EXPORT: "model.state_dict()", Call.MEAN: "parallax.global_mean()",
         Call.EVALUATE: "a forward without gradients (evaluation)",
         Call.LAYER: "a call of an embedding layer (model.emb(ids))",
         Call.READ: "a read of a whole server-held parameter (model.emb.weight.norm())"}

SOME_RANKS_EVALUATE = (
    "A forward is collective under parallax (its rows come from every server), so the DDP "
    "habit of evaluating on rank 0 alone cannot run. Evaluate on every rank, each its share "
    "of the data (parallax.shard of the evaluation loader; all_reduce the metric or use "
    "parallax.global_mean), or give rank 0 a plain copy: state = model.state_dict() on every "
    "rank (collective), then on rank 0 plain.load_state_dict(state) into a model built as "
    "the single-device program builds it, and evaluate that.")


VALUES = 2  # numbers a rank's loop-order message carries besides its call and step
WIDTH = 2 + VALUES  # the message: call, step, values


class LoopOrder:
    """``enabled`` by `parallax.distribute`; ``applies``: several workers in the same step."""

    def __init__(self, worker: WorkerInfo, group: dist.ProcessGroup, explained: Explainer, *,
                 applies: bool) -> None:
        self.explained = explained
        self.worker = worker
        self.group = group
        self.applies = applies and worker.world_size > 1
        self.enabled = False
        self.device = worker.device  # (once: the property asks CUDA each time)

    def check(self, call: Call, step: int) -> None:
        """Every rank is about to make ``call`` in step ``step``, or all raise naming who is
        elsewhere (collective when enabled)."""
        if self.enabled and self.applies:
            self.gather_numbers(call, step, ())

    def meet(self, call: Call, step: int, numbers: Sequence[float] | None = None,
             ) -> list[list[float]]:
        """`check` of ``call`` in ``step`` where ``numbers`` is None (no rank's numbers:
        empty), else `gather_numbers` of them (collective on every rank)."""
        if numbers is None:
            self.check(call, step)
            return []
        return self.gather_numbers(call, step, numbers)

    def gather(self, call: Call, step: int, values: torch.Tensor) -> torch.Tensor:
        """`gather_numbers` of ``values`` (up to `VALUES` float64 numbers, on the worker's
        device, read by the collective and not before), a row per rank."""
        mine = torch.zeros(WIDTH, dtype=torch.float64, device=values.device)
        mine[0], mine[1] = float(call), float(step)
        if values.numel():
            mine[2:2 + values.numel()] = values.reshape(-1)
        rows = self._everyone(mine)
        if self.enabled and self.applies:
            self._same_place(rows[:, :2].tolist())
        return rows[:, 2:2 + values.numel()]

    def gather_numbers(self, call: Call, step: int, numbers: Sequence[float],
                       ) -> list[list[float]]:
        """Every rank's ``numbers`` (up to `VALUES`), a list per rank, by one collective that
        is also `check`'s of ``call`` in ``step`` where the check is enabled. Collective on
        every rank whatever ``enabled`` says (the caller's steps are aligned). Every call
        sends the same message (zeros past ``numbers``), so ranks at different calls meet in
        the same all_gather and are named rather than failing in gloo."""
        padding = (0.0,) * (VALUES - len(numbers))
        mine = torch.tensor((float(call), float(step), *numbers, *padding), dtype=torch.float64)
        if self.device.type != "cpu":  # (a copy that does not wait for the device's queue)
            mine = mine.to(self.device, non_blocking=True)
        rows = self._everyone(mine).tolist()
        if self.enabled and self.applies:
            self._same_place(rows)
        return [row[2:2 + len(numbers)] for row in rows]

    def _everyone(self, mine: torch.Tensor) -> torch.Tensor:
        """Every rank's message ``mine`` (`WIDTH` float64), a row per rank."""
        everyone = mine.new_empty(WIDTH * self.worker.world_size)
        with self.explained:
            process_group.all_gather_single(everyone, mine, group=self.group)
        return everyone.view(self.worker.world_size, WIDTH)

    def _same_place(self, rows: list[list[float]]) -> None:
        """Raise naming the ranks whose (call, step), the first two numbers of their
        ``rows``, differ from rank 0's."""
        first = rows[0][:2]
        if all([row[:2] == first for row in rows]):  # (a list: every step asks)
            return
        where = [(Call(int(row[0])), int(row[1])) for row in rows]
        odd = [r for r, w in enumerate(where) if w != where[0]]
        raise UnsupportedProgramError(
            f"rank {self.worker.rank}: the ranks' training loops diverged: rank 0 called "
            f"{_SAID[where[0][0]]} in step {where[0][1]}, "
            + ", ".join(f"rank {r} {_SAID[where[r][0]]} in step {where[r][1]}" for r in odd)
            + ". Every rank must call the model and optimizer.step() in the same order (no "
            "rank may skip a step or run an extra forward)."
            + (f" {COLLECTIVE_EXPORT}" if Call.EXPORT in {w[0] for w in where} else "")
            + (f" {SOME_RANKS_EVALUATE}" if Call.EVALUATE in {w[0] for w in where} else ""))

    def check_export(self, step: int) -> None:
        """`check` of an export, saying it is collective when another rank already ended."""
        try:
            self.check(Call.EXPORT, step)
        except UnevenInputsError as error:  # the other ranks ended: this rank exports alone
            raise UnevenInputsError(
                f"rank {self.worker.rank} called model.state_dict() after another rank ended "
                f"({error}). {COLLECTIVE_EXPORT}") from error
