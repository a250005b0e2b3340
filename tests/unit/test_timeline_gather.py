"""The timeline at shutdown (`PhaseClock.write`): every rank hands its events to rank 0 through
the job's store and rank 0 writes one trace, so ranks on other hosts need no shared file system
and a job under plain ``torchrun`` (``PARALLAX_TIMELINE=FILE``) gets the same file; a rank that
never hands its events in is left out after a bounded wait, and named."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch.distributed as dist

from parallax.engine.diagnostics import phases
from parallax.engine.diagnostics.phases import PhaseClock


def _clock(rank: int, path: Path, store: dist.Store, world: int = 2) -> PhaseClock:
    clock = PhaseClock(rank, str(path), world_size=world, store=store)
    clock.begin(1)
    with clock.phase("pull"):
        pass
    clock.end()
    return clock


def _ranks_in(path: Path) -> set[int]:
    events = json.loads(path.read_text())["traceEvents"]
    return {e["pid"] for e in events if e["ph"] == "X"}


def test_rank_zero_writes_every_ranks_phases(tmp_path: Path) -> None:
    store, path = dist.HashStore(), tmp_path / "trace.json"
    zero, one = _clock(0, path, store), _clock(1, path, store)
    assert one.write() is None and not path.exists()  # handed in, nothing written
    assert zero.write() == path
    assert _ranks_in(path) == {0, 1}


def test_a_rank_that_never_hands_in_is_left_out_and_named(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(phases, "_GATHER_S", 0.2)
    store, path = dist.HashStore(), tmp_path / "trace.json"
    with caplog.at_level(logging.WARNING, logger="parallax"):
        assert _clock(0, path, store, world=3).write() == path
    assert _ranks_in(path) == {0}
    assert "the timeline leaves out rank(s) 1, 2" in caplog.text


def test_no_step_no_file(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    assert PhaseClock(0, str(path)).write() is None and not path.exists()
