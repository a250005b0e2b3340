"""The cost model of batch, model and integrated parallelism, and the choice of a grid.

The report's formulas (α latency per message, β seconds per byte, P processes, layers of
``|W_l|`` weights and width ``d_l``, batch ``B``), per process and step:

* batch: ``2 Σ_l (α ⌈log P⌉ + β (P-1)/P |W_l|)``
* model: ``3 Σ_l (α ⌈log P⌉ + β B (P-1)/P d_l)``

`report_bytes` gives their β terms in bytes. What parallax runs differs where it saves a
collective (`parallax.parallelism.splits`: column/row pairs), so `scheme_collectives` lists the
collectives the chosen splits issue, per communicator, each with its bytes by gloo's ring
schedule; their sum is what `ModelParallel.bytes_per_step` measures (the equality is tested).
`predict` prices them with ring latencies, ``2 (k-1) α`` for an all-reduce in a group of ``k``
and ``(k-1) α`` for an all-gather (gloo's rings, not the report's tree ``⌈log P⌉``), adds the
measured compute of each process's share of the matrix products, and `choose_grid` takes the
cheapest grid.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from parallax.parallelism.grid import Grid
from parallax.parallelism.splits import LinearSplit, Split, plan_splits

__all__ = ["Collective", "Link", "Prediction", "choose_grid", "local_elements", "local_shape",
           "measure_compute", "measure_link", "predict", "predict_grids", "report_bytes",
           "scheme_collectives"]


@dataclass(frozen=True)
class Link:
    """α: seconds per message; β: seconds per byte (one link type for both communicators)."""

    alpha: float
    beta: float


@dataclass(frozen=True)
class Collective:
    """One collective of a step: on which communicator, its kind, group size and the bytes
    one rank sends in it."""

    communicator: str  # "model" or "data"
    kind: str          # "all_reduce" or "all_gather"
    group: int
    sent: float

    def seconds(self, link: Link) -> float:
        hops = 2 * (self.group - 1) if self.kind == "all_reduce" else self.group - 1
        return hops * link.alpha + self.sent * link.beta


def _chunk(width: int, parts: int, index: int) -> int:
    """Width of piece ``index`` of ``width`` split as ``torch.chunk`` (and DTensor) split."""
    size = math.ceil(width / parts)
    return max(0, min(size, width - size * index))


def report_bytes(mode: str, widths: list[int], batch: int, processes: int,
                 itemsize: int) -> float:
    """The β term of the report's ``batch`` or ``model`` formula in bytes: ``widths`` are
    ``[d_0, ..., d_L]`` (input, then each layer's outputs); weights include biases."""
    p = processes
    if mode == "batch":
        weights = sum(widths[i] * widths[i + 1] + widths[i + 1] for i in range(len(widths) - 1))
        return 2 * (p - 1) / p * weights * itemsize
    return 3 * sum(batch * (p - 1) / p * d for d in widths[1:]) * itemsize


def scheme_collectives(splits: list[LinearSplit], grid: Grid, *, batch: int, itemsize: int,
                       model_index: int = 0, first_input_grad: bool = False,
                       other_dense_elements: int = 0) -> list[Collective]:
    """The collectives one step issues on a rank at ``model_index`` of ``grid`` with a global
    ``batch`` (``batch / grid.data`` rows per data group) for a network whose linear layers
    are split as ``splits`` (in the order they run; the first layer's input needs a gradient
    only if ``first_input_grad``). ``other_dense_elements``: trainable elements outside the
    linear layers (reduced over the data group with them)."""
    n, rows = grid.model, batch // grid.data
    out: list[Collective] = []
    for i, s in enumerate(splits):
        input_grad = first_input_grad or i > 0
        if s.split in (Split.COLUMN, Split.GATHERED):
            if s.split == Split.GATHERED:
                piece = rows * math.ceil(s.out_features / n) * itemsize
                out.append(Collective("model", "all_gather", n, (n - 1) * piece))
            if input_grad:
                out.append(Collective("model", "all_reduce", n,
                                      2 * (n - 1) / n * rows * s.in_features * itemsize))
        elif s.split == Split.ROW:
            out.append(Collective("model", "all_reduce", n,
                                  2 * (n - 1) / n * rows * s.out_features * itemsize))
    local = other_dense_elements + local_elements(splits, grid, model_index)
    b = grid.data
    if b > 1:
        out.append(Collective("data", "all_reduce", b,
                              2 * (b - 1) * (local * itemsize) // b))
    return [c for c in out if c.group > 1]


def local_shape(split: LinearSplit, parts: int, index: int = 0) -> tuple[int, int]:
    """``(in, out)`` features of the piece of ``split`` the rank at model ``index`` of
    ``parts`` holds (cut as ``torch.chunk`` cuts; its bias has ``out`` elements: a row
    split's bias is whole everywhere)."""
    if split.split in (Split.COLUMN, Split.GATHERED):
        return split.in_features, _chunk(split.out_features, parts, index)
    if split.split == Split.ROW:
        return _chunk(split.in_features, parts, index), split.out_features
    return split.in_features, split.out_features


def local_elements(splits: list[LinearSplit], grid: Grid, model_index: int) -> int:
    """Elements of the linear layers' weights and biases a rank at ``model_index`` holds."""
    shapes = [local_shape(s, grid.model, model_index) for s in splits]
    return sum(i * o + o for i, o in shapes)


@dataclass(frozen=True)
class Prediction:
    """A grid's predicted step: communication and compute seconds, bytes per communicator."""

    grid: Grid
    communication_s: float
    compute_s: float
    model_bytes: float
    data_bytes: float

    @property
    def total_s(self) -> float:
        return self.communication_s + self.compute_s


def predict(splits: list[LinearSplit], grid: Grid, link: Link, *, batch: int, itemsize: int,
            compute_s: float) -> Prediction:
    """``grid``'s step time by the cost model (see the module docstring)."""
    collectives = scheme_collectives(splits, grid, batch=batch, itemsize=itemsize)
    return Prediction(grid, sum(c.seconds(link) for c in collectives), compute_s,
                      sum(c.sent for c in collectives if c.communicator == "model"),
                      sum(c.sent for c in collectives if c.communicator == "data"))


def measure_compute(splits: list[LinearSplit], grid: Grid, *, batch: int, dtype: torch.dtype,
                    repeats: int = 3) -> float:
    """Seconds of one process's matrix products for a step on ``grid`` (forward, and the
    backward's two products per layer), timed here on this process's shapes: the median of
    ``repeats``."""
    rows = max(1, batch // grid.data)
    shapes = [local_shape(s, grid.model) for s in splits]
    tensors = [(torch.randn(rows, i, dtype=dtype), torch.randn(i, o, dtype=dtype),
                torch.randn(rows, o, dtype=dtype)) for i, o in shapes]
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        for x, w, g in tensors:
            x @ w
            g @ w.T
            x.T @ g
        times.append(time.perf_counter() - began)
    return sorted(times)[len(times) // 2]


def measure_link(group: dist.ProcessGroup, world_size: int, *,
                 sizes: tuple[int, ...] = (4, 16 << 10, 256 << 10, 1 << 20),
                 repeats: int = 5) -> Link:
    """α and β of this cluster (collective over ``group``): all-reduces of ``sizes`` bytes
    timed (median of ``repeats``) and ``t = 2 (P-1) α + 2 (P-1)/P n β`` fitted by least
    squares over them. Messages of several sizes, because a one-value all-reduce alone
    under-reads the per-message cost that the kilobyte-sized activations of a split layer
    pay (on the emulated network, replayed kilobyte collectives took milliseconds where a
    one-value α predicted tenths of one: records model_parallel-*)."""
    if world_size == 1:
        return Link(0.0, 0.0)
    p = world_size
    rows, times = [], []
    for size in sizes:
        tensor = torch.zeros(max(1, size // 4))
        dist.all_reduce(tensor, group=group)  # warm the connections
        samples = []
        for _ in range(repeats):
            began = time.perf_counter()
            dist.all_reduce(tensor, group=group)
            samples.append(time.perf_counter() - began)
        rows.append([2 * (p - 1), 2 * (p - 1) / p * tensor.numel() * 4])
        times.append(sorted(samples)[len(samples) // 2])
    (alpha, beta), *_ = np.linalg.lstsq(np.array(rows), np.array(times), rcond=None)
    return Link(max(float(alpha), 0.0), max(float(beta), 0.0))


def grids_of(world_size: int) -> list[Grid]:
    """Every ``data x model`` factorisation of ``world_size``, pure batch parallelism first."""
    return [Grid(world_size // m, m) for m in range(1, world_size + 1) if world_size % m == 0]


def predict_grids(model: nn.Module, world_size: int, *, batch: int, link: Link,
                  pairs: bool = True) -> list[Prediction]:
    """Every grid of ``world_size`` priced for ``model`` (what ``parallelism="auto"``
    compares): its splits (``pairs``: `Config.model_split`) collectives at ``link``, and the
    compute of its shapes timed here."""
    params = [p for p in model.parameters() if p.requires_grad]
    dtype = params[0].dtype if params else torch.float32
    itemsize = torch.empty((), dtype=dtype).element_size()
    predictions = []
    for grid in grids_of(world_size):
        splits = plan_splits(model, grid.model, pairs=pairs)
        compute = measure_compute(splits, grid, batch=batch, dtype=dtype)
        predictions.append(predict(splits, grid, link, batch=batch, itemsize=itemsize,
                                   compute_s=compute))
    return predictions


def choose_grid(predictions: list[Prediction]) -> Prediction:
    """The fastest predicted grid (ties go to more data parallelism, listed first)."""
    return min(predictions, key=lambda p: p.total_s)


def explain(predictions: list[Prediction], chosen: Prediction, link: Link, batch: int) -> str:
    """The table `Config(parallelism="auto")` prints: every grid's predicted step."""
    lines = [f"parallelism auto: global batch {batch}, link alpha {link.alpha * 1e6:.1f} us, "
             f"beta {link.beta * 1e9:.3f} ns/byte ({1 / link.beta / 1e6 if link.beta else 0:.0f}"
             f" MB/s)",
             f"  {'grid':>6} {'model MB':>9} {'data MB':>9} {'comm ms':>8} {'comp ms':>8} "
             f"{'total ms':>9}"]
    for p in predictions:
        mark = "  <- chosen" if p is chosen else ""
        lines.append(f"  {p.grid.data}x{p.grid.model:<4} {p.model_bytes / 1e6:9.3f} "
                     f"{p.data_bytes / 1e6:9.3f} {p.communication_s * 1e3:8.2f} "
                     f"{p.compute_s * 1e3:8.2f} {p.total_s * 1e3:9.2f}{mark}")
    return "\n".join(lines)
