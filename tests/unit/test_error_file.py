"""A worker's error file is written whole or not at all (`WholeFileErrorHandler`): the
elastic agent parses it as soon as the worker is gone, and torch's own open-then-write left an
empty file when the agent stopped the worker in between, which crashed the launcher with a
JSONDecodeError instead of naming the failed rank (seen in CI under sync="async", twice:
torch's ``record_exception`` writes the file itself, past the handler's ``_write_error_file``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from parallax.launch.elastic import WholeFileErrorHandler

pytestmark = pytest.mark.unit


def test_the_recorded_error_is_one_the_agent_can_read(tmp_path: Path, monkeypatch) -> None:
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    try:
        raise RuntimeError("deliberate failure")
    except RuntimeError as error:
        WholeFileErrorHandler().record_exception(error)
    assert json.loads(error_file.read_text())["message"]["message"] == (
        "RuntimeError: deliberate failure")
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(error_file))
    assert "deliberate failure" in str(failure.message)
    assert list(tmp_path.iterdir()) == [error_file]  # no partial file left beside it


def test_a_write_cut_short_leaves_no_error_file(tmp_path: Path, monkeypatch) -> None:
    """A write that fails half-way (as a stopped worker's would) leaves no file, so the agent
    reads the worker as failed without a record rather than failing on an empty one."""
    error_file = tmp_path / "error.json"
    real_fdopen = os.fdopen

    class CutShort:
        def __init__(self, handle):
            self.handle = handle

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

        def write(self, text: str) -> int:
            self.handle.write(text[:3])
            raise OSError("stopped mid-write")

    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setattr(os, "fdopen", lambda *args, **kwargs: CutShort(
        real_fdopen(*args, **kwargs)))
    try:
        raise RuntimeError("deliberate failure")
    except RuntimeError as error:
        WholeFileErrorHandler().record_exception(error)  # the hook's call, not a helper's
    monkeypatch.setattr(os, "fdopen", real_fdopen)
    assert list(tmp_path.iterdir()) == []


def test_the_record_never_opens_the_error_file_itself(tmp_path: Path, monkeypatch) -> None:
    """torch's ``record_exception`` opens (truncates) the file, then writes: the empty file a
    stopped worker left there. The record must reach the file only by a rename."""
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    real_open = open

    def guarded_open(file, *args, **kwargs):
        assert os.fspath(file) != str(error_file), "the error file was opened in place"
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", guarded_open)
    try:
        raise RuntimeError("deliberate failure")
    except RuntimeError as error:
        WholeFileErrorHandler().record_exception(error)
    monkeypatch.setattr("builtins.open", real_open)
    assert json.loads(error_file.read_text())["message"]["message"] == (
        "RuntimeError: deliberate failure")
