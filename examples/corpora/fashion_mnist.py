"""Fashion-MNIST from Debian's ``dataset-fashion-mnist`` package (idx files), for the dense
CNN workload: fetched once into the cache, read with numpy."""

from __future__ import annotations

import fcntl
import gzip
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch

from corpora.cache import default_cache_dir, require_online
from corpora.kjv import FETCH_COMMANDS, download_deb

PACKAGE = "dataset-fashion-mnist"
FILES = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
         "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}


def fetch_fashion_mnist(cache_dir: Path | None = None) -> Path:
    """The directory holding the four idx files, downloaded on first use (one process
    downloads, concurrent ones wait)."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache / "fashion-mnist"
    names = [name for pair in FILES.values() for name in pair]
    if all((target / name).exists() for name in names):
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".fashion-mnist.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not all((target / name).exists() for name in names):
            require_online(PACKAGE, FETCH_COMMANDS[PACKAGE])
            with tempfile.TemporaryDirectory(prefix="fmnist-", dir=cache) as tmp:
                deb = download_deb(Path(tmp), PACKAGE)
                subprocess.run(["dpkg", "-x", str(deb), str(Path(tmp) / "root")], check=True)
                source = Path(tmp) / "root" / "usr" / "share" / "datasets" / "fashion-mnist"
                staging = Path(tmp) / "staging"
                shutil.copytree(source, staging)
                if target.exists():
                    shutil.rmtree(target)
                staging.replace(target)  # atomic: a crash leaves no half-filled directory
    return target


def load_fashion_mnist(split: str = "train", cache_dir: Path | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(images [N, 1, 28, 28] float32 in [0, 1], labels [N] int64)``."""
    if split not in FILES:
        raise ValueError(f"split must be one of {sorted(FILES)}, got {split!r}")
    root = fetch_fashion_mnist(cache_dir)
    images_file, labels_file = FILES[split]
    images = _idx(root / images_file, magic=2051)
    labels = _idx(root / labels_file, magic=2049)
    return (torch.from_numpy(images.astype(np.float32) / 255.0).unsqueeze(1),
            torch.from_numpy(labels.astype(np.int64)))


def _idx(path: Path, magic: int) -> np.ndarray:
    """An idx file: big-endian magic, dimension sizes, then uint8 data."""
    data = gzip.decompress(path.read_bytes())
    found = int.from_bytes(data[:4], "big")
    if found != magic:
        raise ValueError(f"{path}: idx magic {found}, expected {magic}")
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)
