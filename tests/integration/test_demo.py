"""The README's first command runs the main job end to end (shortened by its own flags)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.network
def test_readme_demo_command_trains_and_reports(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    # what the library is, how to install it, the port, then the two commands (and this one)
    sections = readme.split("\n## ")
    assert [part.split("\n", 1)[0] for part in sections[1:4]] == [
        "Install", "The port", "Two commands on a fresh machine"], "the README's order"
    assert "pip install" in sections[1] and "parallax.distribute(" in sections[2]
    assert "bash scripts/demo.sh" in sections[3] and "bash scripts/test.sh" in sections[3]
    proc = subprocess.run(
        ["bash", "scripts/demo.sh", "--max-steps", "15", "--max-valid-batches", "3",
         "--vocab", "2000"],
        capture_output=True, text=True, timeout=900, cwd=ROOT)
    out = proc.stdout
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "parallax plan (hybrid): 4 worker(s) on 2 machine(s)" in out
    assert "measured inter-machine bytes per machine and step" in out
    assert "embedding.weight" in out and "sparse" in out and "PS: 2 partition(s)" in out
    assert "words/s on 4 workers; validation perplexity" in out
    assert "exported a plain state_dict" in out
