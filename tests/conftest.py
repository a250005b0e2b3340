"""Shared pytest configuration."""

import pytest


def pytest_configure(config: pytest.Config) -> None:
    """Register custom markers so ``-m "not network"`` works without warnings."""
    config.addinivalue_line("markers", "network: test downloads data (apt-get); deselect offline")
