"""The benchmark LM's batches: synthetic Zipf stream and real-text windows."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from workloads import LMConfig, log_uniform, text_lm_batch, zipf_lm_batch  # noqa: E402

CFG = LMConfig(vocab=50, seq_len=6, batch=3, sampled=7)


def test_text_batches_are_corpus_windows_with_targets_first() -> None:
    windows = torch.arange(40 * 7).view(40, 7) % 50
    (tokens, candidates), labels = text_lm_batch(CFG, windows, torch.Generator().manual_seed(0))
    assert tokens.shape == (3, 6) and candidates.shape == (3 * 6 + 7,)
    rows = [next(w for w in windows if torch.equal(w[:-1], t)) for t in tokens]
    targets = torch.stack([w[1:] for w in rows]).reshape(-1)
    assert torch.equal(candidates[:18], targets)  # label i is candidate i
    assert torch.equal(labels, torch.arange(18))
    assert 0 <= int(candidates.min()) and int(candidates.max()) < 50


def test_zipf_batches_are_reproducible_and_favour_small_ids() -> None:
    first = zipf_lm_batch(CFG, torch.Generator().manual_seed(3))
    again = zipf_lm_batch(CFG, torch.Generator().manual_seed(3))
    assert torch.equal(first[0][0], again[0][0]) and torch.equal(first[0][1], again[0][1])
    ids = log_uniform(1000, 20_000, torch.Generator().manual_seed(0))
    assert 0 <= int(ids.min()) and int(ids.max()) < 1000
    # log-uniform: P(id < 31) = log(32)/log(1001) ≈ 0.50
    assert 0.45 < float((ids < 31).float().mean()) < 0.55
