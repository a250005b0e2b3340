"""The documentation site (mkdocs.yml, docs/): it builds with warnings as errors, and its API
reference, generated from the docstrings, holds every public name of `parallax`."""

from __future__ import annotations

import inspect
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import parallax

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    if shutil.which("mkdocs", path=str(Path(sys.executable).parent)) is None:
        pytest.fail("mkdocs is missing: bash scripts/setup.sh installs it (the dev extra)")
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([str(Path(sys.executable).parent / "mkdocs"), "build", "--strict",
                           "--site-dir", str(out)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def test_the_site_builds_with_warnings_as_errors(site) -> None:
    for page in ("index.html", "reference/api/index.html", "troubleshooting/index.html",
                 "concepts/asynchronous/index.html", "tutorials/lm/index.html"):
        assert (site / page).is_file(), page
    # the benchmark figures are served from benchmarks/figures, not copied into docs/
    assert (site / "figures" / "async.png").is_file()
    # and the Table 3 figure is drawn from the planner's formulas at build time
    assert (site / "figures" / "table3.png").stat().st_size > 10_000


def test_every_public_name_is_in_the_api_reference(site) -> None:
    api = (site / "reference" / "api" / "index.html").read_text()
    anchors = set(re.findall(r'id="(parallax\.[\w.]+)"', api))
    missing = [name for name in parallax.__all__ if f"parallax.{name}" not in anchors]
    assert not missing, missing
    methods = [name for name, _ in inspect.getmembers(parallax.Runner)
               if not name.startswith("_")]
    missing = [name for name in methods if f"parallax.Runner.{name}" not in anchors]
    assert not missing, missing


def test_every_public_error_is_in_troubleshooting(site) -> None:
    page = (site / "troubleshooting" / "index.html").read_text()
    errors = [name for name in parallax.__all__ if name.endswith("Error") or name == "PlanComplete"]
    assert [name for name in errors if name not in page] == []
