"""QSGD's codec (Alistarh et al., random quantisation SGD): a vector travels as bytes.

A vector of ``n`` values is cut into buckets of ``d = bucket_size``; bucket ``b`` is sent as its
L2 norm ``‖v_b‖`` (one value of the vector's dtype) and, per value, a level
``l = ⌊s·|v|/‖v_b‖ + u⌋`` with ``u ~ U[0, 1)`` and its sign, ``s = 2**(bits-1) - 1``. Decoding
gives ``‖v_b‖·sign·l/s``, whose expectation is ``v``: the rounding goes up with probability
equal to the remainder. Levels with their sign are stored offset by ``s`` (in ``[0, 2s]``, which
fits ``bits``) and packed ``8 // bits`` to a byte. Payload: the norms first, then the codes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class QSGDCodec:
    """``encode``/``decode`` of `parallax.QSGD`'s ``bits`` and ``bucket_size``."""

    bits: int = 8
    bucket_size: int = 512

    @property
    def levels(self) -> int:
        """``s``: the largest level; a value is one of ``‖v_b‖·k/s``, ``k in [-s, s]``."""
        return int(2 ** (self.bits - 1) - 1)

    def encoded_bytes(self, n: int, dtype: torch.dtype) -> int:
        """Bytes of the payload of ``n`` values of ``dtype``: one norm per bucket, ``bits``
        per value (rounded up to whole bytes once, at the end)."""
        buckets = math.ceil(n / self.bucket_size)
        element = torch.empty((), dtype=dtype).element_size()
        return buckets * element + math.ceil(n * self.bits / 8)

    def encode(self, values: Tensor, generator: torch.Generator) -> Tensor:
        """The uint8 payload of the flat ``values``; ``generator`` draws the rounding."""
        flat = values.reshape(-1)
        n = flat.numel()
        if n == 0:
            return torch.empty(0, dtype=torch.uint8, device=flat.device)
        buckets = math.ceil(n / self.bucket_size)
        padded = torch.zeros(buckets * self.bucket_size, dtype=flat.dtype, device=flat.device)
        padded[:n] = flat
        padded = padded.view(buckets, self.bucket_size)
        norms = torch.linalg.vector_norm(padded, dim=1)
        safe = torch.where(norms > 0, norms, torch.ones_like(norms))
        scaled = padded.abs() / safe[:, None] * self.levels
        noise = torch.rand(scaled.shape, generator=generator, dtype=scaled.dtype,
                           device=scaled.device)
        level = torch.floor(scaled + noise).clamp_(0, self.levels)
        codes = (torch.sign(padded) * level + self.levels).reshape(-1)[:n].to(torch.uint8)
        return torch.cat([_as_bytes(norms), self._pack(codes)])

    def decode(self, payload: Tensor, n: int, dtype: torch.dtype) -> Tensor:
        """The ``n`` values of ``dtype`` a payload of `encode` stands for."""
        if n == 0:
            return torch.empty(0, dtype=dtype, device=payload.device)
        buckets = math.ceil(n / self.bucket_size)
        element = torch.empty((), dtype=dtype).element_size()
        norms = payload[:buckets * element].clone().view(dtype)
        codes = self._unpack(payload[buckets * element:], n)
        levels = codes.to(dtype) - self.levels
        scale = norms.repeat_interleave(self.bucket_size)[:n] / self.levels
        return levels * scale

    def _pack(self, codes: Tensor) -> Tensor:
        per = 8 // self.bits
        if per == 1:
            return codes
        padded = torch.zeros(math.ceil(codes.numel() / per) * per, dtype=torch.uint8,
                             device=codes.device)
        padded[:codes.numel()] = codes
        shifts = torch.arange(per, dtype=torch.uint8, device=codes.device) * self.bits
        return (padded.view(-1, per) << shifts).sum(dim=1, dtype=torch.uint8)

    def _unpack(self, packed: Tensor, n: int) -> Tensor:
        per = 8 // self.bits
        if per == 1:
            return packed[:n]
        shifts = torch.arange(per, dtype=torch.uint8, device=packed.device) * self.bits
        mask = (1 << self.bits) - 1
        return ((packed[:, None] >> shifts) & mask).reshape(-1)[:n]


def _as_bytes(values: Tensor) -> Tensor:
    return values.contiguous().view(torch.uint8).reshape(-1)
