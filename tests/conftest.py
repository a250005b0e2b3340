"""Shared pytest configuration."""

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
# The demo corpora (examples/corpora) and the example model are not part of the library; the
# shared equivalence matrix (equivalence_cases.py) sits beside this file.
sys.path.insert(0, str(TESTS.parent / "examples"))
sys.path.insert(0, str(TESTS))

TIERS = ("unit", "integration", "equivalence", "benchmarks")


#: How the suite's launched workers start unless a test's ``start_method`` marker says
#: otherwise: forked from a process that imported torch once (`parallax.launch.warm`), which
#: saves each worker the seconds of ``import torch`` a fresh interpreter pays. Users' default
#: is ``exec``; the launcher's own tests (failures, restarts, signals, ssh) and the parity
#: test of the two (test_start_methods.py) run it, and ``PARALLAX_START_METHOD=exec`` set
#: for pytest runs the whole suite that way.
SUITE_START_METHOD = os.environ.get("PARALLAX_START_METHOD") or "forkserver"
# for the module-scoped fixtures' launches too: they start before a test's own fixtures
os.environ["PARALLAX_START_METHOD"] = SUITE_START_METHOD


@pytest.fixture(autouse=True)
def _isolated_environment(request: pytest.FixtureRequest) -> Iterator[None]:
    """Each test starts from the same environment variables: a one-worker runner sets RANK and
    WORLD_SIZE, which a later test's launched workers must not inherit (parallax.shutdown
    restores them; this also covers a test that failed before calling it). Its launches'
    start method is `SUITE_START_METHOD` or its ``start_method`` marker's."""
    saved = dict(os.environ)
    marker = request.node.get_closest_marker("start_method")
    os.environ["PARALLAX_START_METHOD"] = marker.args[0] if marker else SUITE_START_METHOD
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def single_process() -> Iterator[None]:
    """A test that builds a one-worker runner in this process: shut parallax down after it."""
    yield
    import parallax

    parallax.shutdown()


def pytest_configure(config: pytest.Config) -> None:
    """Register custom markers so ``-m "not network"`` works without warnings."""
    config.addinivalue_line("markers", "network: test downloads data (apt-get); deselect offline")
    config.addinivalue_line("markers", "unit: in-process, no worker launches (tests/unit)")
    config.addinivalue_line("markers", "integration: launches workers (tests/integration)")
    config.addinivalue_line("markers", "equivalence: distributed = single device "
                                       "(tests/equivalence)")
    config.addinivalue_line("markers", "benchmarks: workloads and the harness "
                                       "(tests/benchmarks)")
    config.addinivalue_line("markers", "gpu: needs CUDA (skipped without it; run by "
                                       "scripts/gpu_check.sh on a GPU machine)")
    config.addinivalue_line("markers", "start_method(name): how the test's launched workers "
                                       "start (exec or forkserver; see SUITE_START_METHOD)")
    config.addinivalue_line("markers", "fast: part of the fast tier (scripts/test.sh --fast) "
                                       "outside tests/unit")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each test is marked with its folder's tier, so ``-m unit`` selects a folder."""
    for item in items:
        parts = Path(str(item.fspath)).resolve().relative_to(TESTS).parts
        if parts and parts[0] in TIERS:
            item.add_marker(getattr(pytest.mark, parts[0]))
