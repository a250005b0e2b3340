"""Fashion-MNIST from Debian's package: idx decoding, and the real files."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
from corpora.fashion_mnist import _idx, load_fashion_mnist


def test_idx_decoding(tmp_path: Path) -> None:
    data = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    header = (2051).to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in data.shape)
    path = tmp_path / "x.gz"
    path.write_bytes(gzip.compress(header + data.tobytes()))
    assert np.array_equal(_idx(path, magic=2051), data)
    with pytest.raises(ValueError, match="idx magic 2051, expected 2049"):
        _idx(path, magic=2049)


@pytest.mark.network
def test_real_fashion_mnist(tmp_path: Path) -> None:
    images, labels = load_fashion_mnist("test", tmp_path)
    assert images.shape == (10_000, 1, 28, 28) and labels.shape == (10_000,)
    assert 0.0 <= float(images.min()) and float(images.max()) == 1.0
    assert sorted(labels.unique().tolist()) == list(range(10))
