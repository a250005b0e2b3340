"""Shared pytest configuration."""

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# The demo corpora (examples/corpora) and the example model are not part of the library.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


@pytest.fixture(autouse=True)
def _isolated_environment() -> Iterator[None]:
    """Each test starts from the same environment variables: a one-worker runner sets RANK and
    WORLD_SIZE, which a later test's launched workers must not inherit (parallax.shutdown
    restores them; this also covers a test that failed before calling it)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def pytest_configure(config: pytest.Config) -> None:
    """Register custom markers so ``-m "not network"`` works without warnings."""
    config.addinivalue_line("markers", "network: test downloads data (apt-get); deselect offline")
