"""SGD with momentum or weight decay on server-held rows: the steps of untouched rows deferred.

With momentum, dampening, nesterov or weight decay, torch's SGD moves every row of a parameter
at every step, also the rows whose gradient is zero. For such a row one step is a linear map of
its value ``p`` and momentum buffer ``buf`` (torch's ``_single_tensor_sgd`` with ``grad = 0``):

    g    = wd·p
    buf' = m·buf + (1 − dampening)·g          (the first step: buf' = g)
    p'   = p − lr·(g + m·buf')   (nesterov)   or   p − lr·buf'

A server therefore applies the real step to the rows that received gradient only, and records
the step's zero-gradient map; a row's skipped steps are composed into one map (in float64) and
applied when the row is next read: pulled, gathered, checkpointed, exported, its optimizer state
read or replaced, its value assigned, or before it is stepped again. The result equals the dense
update up to rounding (composition reassociates the products), which the equivalence suite
bounds at 1e-9 in float64. Every `FLUSH_EVERY` steps all rows are brought up to date, so the
record stays short.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.optim.sgd import sgd

from parallax.errors import InternalError

__all__ = ["FLUSH_EVERY", "DeferredRows", "sgd_rows", "zero_gradient_map"]

# Steps recorded before every row of a partition is brought up to date (bounds the cost of a
# catch-up, which composes the recorded maps, and the step count each row keeps: int16).
FLUSH_EVERY = 128

# (a, b, c, d): p' = a·p + b·buf, buf' = c·p + d·buf
Map = tuple[float, float, float, float]
IDENTITY: Map = (1.0, 0.0, 0.0, 1.0)


def zero_gradient_map(group: dict[str, Any], has_buffer: bool) -> Map:
    """One SGD step of ``group``'s hyper-parameters on an element whose gradient is zero, as a
    linear map of (value, momentum buffer); ``has_buffer``: whether the buffer exists yet
    (torch creates it at the first step, as a copy of the gradient)."""
    lr, wd = float(group["lr"]), float(group["weight_decay"])
    momentum, dampening = float(group["momentum"]), float(group["dampening"])
    if momentum == 0:  # no buffer involved (one that exists stays as it is)
        return (1.0 - lr * wd, 0.0, 0.0, 1.0)
    c, d = ((1.0 - dampening) * wd, momentum) if has_buffer else (wd, 0.0)
    if group["nesterov"]:
        return (1.0 - lr * wd - lr * momentum * c, -lr * momentum * d, c, d)
    return (1.0 - lr * c, -lr * d, c, d)


def _compose(outer: Map, inner: Map) -> Map:
    """``outer`` after ``inner``."""
    a, b, c, d = outer
    e, f, g, h = inner
    return (a * e + b * g, a * f + b * h, c * e + d * g, c * f + d * h)


class DeferredRows:
    """The steps a partition's rows still owe: the zero-gradient maps of the steps since the
    last flush, and per row how many of them it has had."""

    def __init__(self, num_rows: int, device: torch.device):
        self.maps: list[Map] = []
        self.done = torch.zeros(num_rows, dtype=torch.int16, device=device)

    @property
    def pending(self) -> bool:
        return bool(self.maps)

    def catch_up(self, part: Tensor, buf: Tensor | None, rows: Tensor | None = None) -> None:
        """Apply to ``rows`` (all when None) of ``part`` (values, in place) and ``buf`` (its
        momentum buffer, or None) the steps they skipped."""
        total = len(self.maps)
        if total == 0:
            return
        done = self.done if rows is None else self.done[rows]
        lagging = (done != total).nonzero().squeeze(1)
        if lagging.numel() == 0:
            return
        rows = lagging if rows is None else rows[lagging]
        suffix = [IDENTITY] * (total + 1)  # suffix[s]: the maps s, s+1, ... composed
        for step in range(total - 1, -1, -1):
            suffix[step] = _compose(suffix[step + 1], self.maps[step])
        coefficients = torch.tensor(suffix, dtype=torch.float64, device=part.device)
        a, b, c, d = coefficients[done[lagging].long()].unbind(1)
        shape = (-1,) + (1,) * (part.dim() - 1)
        a, b, c, d = (x.view(shape) for x in (a, b, c, d))
        values = part[rows].double()
        if buf is None:
            part[rows] = (a * values).to(part.dtype)
        else:
            momenta = buf[rows].double()
            part[rows] = (a * values + b * momenta).to(part.dtype)
            buf[rows] = (c * values + d * momenta).to(buf.dtype)
        self.done[rows] = total

    def record(self, step: Map, stepped: Tensor) -> None:
        """One more step: ``stepped`` rows had it for real, the others owe ``step``."""
        self.maps.append(step)
        self.done[stepped] = len(self.maps)

    def flush(self, part: Tensor, buf: Tensor | None) -> None:
        """Bring every row up to date and forget the recorded steps."""
        self.catch_up(part, buf)
        self.maps.clear()
        self.done.zero_()


def sgd_rows(part: Tensor, grad: Tensor, buf: Tensor | None, rows: Tensor, group: dict[str, Any],
             ) -> Tensor | None:
    """torch's SGD step (its own functional ``sgd``, so the arithmetic is the optimizer's) on
    ``rows`` of ``part`` with their ``grad`` rows, in place; ``buf``: the momentum buffer
    (None before the first step). Returns the buffer after the step (None without momentum);
    a new one is zero outside ``rows`` (those rows' buffers are made by their catch-up)."""
    momentum = float(group["momentum"])
    whole = rows.numel() == part.shape[0]
    values = part if whole else part[rows]
    buffers = [None if buf is None else (buf if whole else buf[rows])]
    sgd([values], [grad if whole else grad[rows]], buffers,
        weight_decay=group["weight_decay"], momentum=momentum, lr=group["lr"],
        dampening=group["dampening"], nesterov=group["nesterov"], maximize=group["maximize"],
        foreach=False)
    if not whole:
        part[rows] = values
    if momentum == 0:
        return buf
    filled = buffers[0]
    if filled is None:
        raise InternalError("torch's sgd left no momentum buffer; please report it")
    if whole:
        return filled
    if buf is None:
        buf = torch.zeros_like(part)
    buf[rows] = filled
    return buf
