"""Corpora are fetched where the network is: a process marked offline (every worker of an
emulated cluster) refuses to download at once, naming the corpus and the command that fetches
it, instead of failing late inside apt-get."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import corpora
import pytest
from corpora.cache import OFFLINE_ENV, CorpusNotCachedError, require_online

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", corpora.CORPORA)
def test_offline_process_refuses_at_once_naming_corpus_and_command(
        name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(OFFLINE_ENV, "1")
    monkeypatch.setenv("PARALLAX_CACHE", str(tmp_path))

    def no_subprocess(*args, **kwargs):
        raise AssertionError(f"an offline process ran {args[0]}")

    monkeypatch.setattr(subprocess, "run", no_subprocess)
    with pytest.raises(CorpusNotCachedError) as err:
        corpora.fetch(name)
    message = str(err.value)
    assert f"python examples/fetch_corpora.py {name}" in message and str(tmp_path) in message
    assert OFFLINE_ENV in message and "emulated machine" in message


def test_offline_process_reads_a_cached_corpus(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "kjv.txt").write_text("In the beginning\n")
    monkeypatch.setenv(OFFLINE_ENV, "1")
    monkeypatch.setenv("PARALLAX_CACHE", str(tmp_path))
    assert corpora.fetch("kjv") == tmp_path / "kjv.txt"
    monkeypatch.setenv(OFFLINE_ENV, "0")  # "0" means online
    require_online("anything", "no command needed")


FETCH = [sys.executable, str(ROOT / "examples" / "fetch_corpora.py")]


def test_fetch_script_rejects_an_unknown_corpus() -> None:
    proc = subprocess.run([*FETCH, "imagenet"], capture_output=True, text=True)
    assert proc.returncode == 2 and "invalid choice: 'imagenet'" in proc.stderr
    with pytest.raises(ValueError, match="unknown corpus 'imagenet'; known: kjv"):
        corpora.fetch("imagenet")


def test_fetch_script_prints_the_cached_path(tmp_path: Path) -> None:
    (tmp_path / "kjv.txt").write_text("In the beginning\n")
    proc = subprocess.run([*FETCH, "kjv"], capture_output=True, text=True,
                          env={**os.environ, "PARALLAX_CACHE": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    assert f"fetch_corpora: kjv: {tmp_path / 'kjv.txt'}" in proc.stdout


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"),
                    reason="the emulated network needs root and iproute2")
def test_emulated_workers_are_offline_and_fail_fast(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(ROOT / 'examples')!r})\n"
                      "from corpora.kjv import fetch_kjv\nfetch_kjv()\n")
    env = {**os.environ, "PARALLAX_CACHE": str(tmp_path / "empty-cache")}
    env.pop(OFFLINE_ENV, None)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "parallax.cli", "run", "--machines", "2",
                           "--nproc-per-machine", "1", "--emulate-network", "1gbit",
                           str(script)], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env=env)
    assert proc.returncode != 0
    assert "corpus kjv.txt is not in the cache" in proc.stderr, proc.stderr[-3000:]
    assert "Fetch it before launching: python examples/fetch_corpora.py kjv" in proc.stderr
    assert time.monotonic() - start < 120  # no apt-get timing out in a namespace
