"""QSGD's codec (`parallax.engine.dense_sync.qsgd_codec`): unbiased, within the paper's
variance bound, never off by more than one level, and exactly ``encoded_bytes`` on the wire."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from parallax.engine.dense_sync.qsgd_codec import QSGDCodec

DRAWS = 4000
#: two-sided normal quantile for a per-coordinate false-alarm rate of 1e-6: over the 300
#: coordinates tested, a correct codec fails with probability <= 3e-4 (Bonferroni); the seed
#: is fixed, so a run is deterministic
K = 4.89


def _draws(codec: QSGDCodec, v: torch.Tensor, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.stack([codec.decode(codec.encode(v, generator), v.numel(), v.dtype)
                        for _ in range(DRAWS)])


def _rounding_std(codec: QSGDCodec, v: torch.Tensor) -> torch.Tensor:
    """Each decoded coordinate's exact standard deviation: it is ``‖v_b‖/s`` times a
    Bernoulli of the remainder ``f`` of ``s·|v|/‖v_b‖``, so ``(‖v_b‖/s)·√(f(1-f))``."""
    n, d = v.numel(), codec.bucket_size
    norms = torch.nn.functional.pad(v, (0, -n % d)).view(-1, d).norm(dim=1)
    norm = norms.repeat_interleave(d)[:n]
    scaled = codec.levels * v.abs() / norm
    f = scaled - scaled.floor()
    return norm / codec.levels * (f * (1 - f)).sqrt()


def _biased(samples: torch.Tensor, v: torch.Tensor, std: torch.Tensor) -> bool:
    """Whether some coordinate's mean is more than K standard errors from ``v`` (normal
    approximation of the mean of ``samples.shape[0]`` draws)."""
    stderr = std / math.sqrt(samples.shape[0])
    return bool(((samples.mean(dim=0) - v).abs() > K * stderr + 1e-12).any())


@pytest.fixture(scope="module")
def vector() -> torch.Tensor:
    return torch.randn(300, dtype=torch.float64, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_decoded_vector_is_unbiased(vector, bits) -> None:
    codec = QSGDCodec(bits=bits, bucket_size=64)
    assert not _biased(_draws(codec, vector), vector, _rounding_std(codec, vector))


def test_the_unbiasedness_test_catches_a_biased_rounding(vector, _half_noise) -> None:
    """The same statistic on rounding to the nearest level (deterministic, biased) fails."""
    codec = QSGDCodec(bits=4, bucket_size=64)
    nearest = codec.decode(codec.encode(vector, _HalfGenerator()), vector.numel(), vector.dtype)
    assert _biased(nearest.expand(DRAWS, -1), vector, _rounding_std(codec, vector))


class _HalfGenerator(torch.Generator):
    """Stands in for the rounding noise: u = 0.5 everywhere is round-to-nearest."""


@pytest.fixture
def _half_noise(monkeypatch):
    real = torch.rand

    def rand(*args, generator=None, **kwargs):
        out = real(*args, generator=None if isinstance(generator, _HalfGenerator) else generator,
                   **kwargs)
        return out.fill_(0.5) if isinstance(generator, _HalfGenerator) else out

    monkeypatch.setattr(torch, "rand", rand)


@pytest.mark.parametrize(("bits", "bucket"), [(2, 16), (4, 64), (8, 512)])
def test_variance_within_the_papers_bound(bits, bucket) -> None:
    """E‖Q(v) - v‖² <= min(d/s², √d/s)·‖v‖² per bucket (QSGD, Lemma 3.1), for a random
    vector and for the flattest one (all entries equal), the hardest for a norm scale."""
    codec = QSGDCodec(bits=bits, bucket_size=bucket)
    s = codec.levels
    bound = min(bucket / s**2, math.sqrt(bucket) / s)
    for v in (torch.randn(bucket, dtype=torch.float64,
                          generator=torch.Generator().manual_seed(1)),
              torch.ones(bucket, dtype=torch.float64)):
        errors = ((_draws(codec, v)[:1000] - v) ** 2).sum(dim=1)
        mean = errors.mean()
        stderr = errors.std() / math.sqrt(errors.numel())
        assert mean <= bound * v.pow(2).sum() + K * stderr, (bits, bucket, float(mean))
        assert mean > 0


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(n=st.integers(0, 700), bits=st.sampled_from([2, 4, 8]),
       bucket=st.integers(1, 600), dtype=st.sampled_from([torch.float32, torch.float64]),
       seed=st.integers(0, 2**31))
def test_payload_is_the_encoded_size_and_one_level_off_at_most(n, bits, bucket, dtype,
                                                               seed) -> None:
    codec = QSGDCodec(bits=bits, bucket_size=bucket)
    generator = torch.Generator().manual_seed(seed)
    v = torch.randn(n, dtype=dtype, generator=generator) * 10 ** (seed % 7 - 3)
    payload = codec.encode(v, generator)
    assert payload.dtype == torch.uint8
    assert payload.numel() == codec.encoded_bytes(n, dtype)
    decoded = codec.decode(payload, n, dtype)
    assert decoded.shape == v.shape and decoded.dtype == dtype
    if n:
        norms = torch.nn.functional.pad(v, (0, -n % bucket)).view(-1, bucket).norm(dim=1)
        step = norms.repeat_interleave(bucket)[:n] / codec.levels
        assert bool(((decoded - v).abs() <= step * (1 + 1e-5) + 1e-30).all())
        assert bool((torch.sign(decoded) * torch.sign(v) >= 0).all())  # never flips a sign


def test_zeros_stay_zero() -> None:
    codec = QSGDCodec()
    zeros = torch.zeros(1000)
    out = codec.decode(codec.encode(zeros, torch.Generator()), 1000, torch.float32)
    assert torch.equal(out, zeros)
