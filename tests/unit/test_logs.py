"""parallax's messages go to the ``"parallax"`` logger (`parallax.logs`): by default rank 0
says what it does and the other ranks only what goes wrong; ``PARALLAX_LOG_ALL_RANKS=1`` makes
every rank say everything; a program that configured logging itself keeps its configuration."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from parallax import logs


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``parallax``'s logger as a program that configured nothing has (the root logger's
    handlers, pytest's among them, are taken off in each test: pytest adds its own once the
    test's call begins)."""
    monkeypatch.setattr(logs.log, "handlers", [])
    monkeypatch.setattr(logs, "_ours", None)
    monkeypatch.delenv(logs.ALL_RANKS_ENV, raising=False)
    level, propagate = logs.log.level, logs.log.propagate
    yield
    logs.log.setLevel(level)
    logs.log.propagate = propagate


def _said(capsys: pytest.CaptureFixture[str]) -> str:
    logs.log.info("parallax: resumed from step 6")
    logs.log.warning("parallax: skipping a damaged checkpoint")
    return capsys.readouterr().err


def _unconfigured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logging.getLogger(), "handlers", [])


def test_rank_zero_says_what_it_does(fresh: None, capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    _unconfigured(monkeypatch)
    logs.configure(0)
    logs.configure(0)  # once per process: one handler, one line per message
    said = _said(capsys)
    assert said == "parallax: resumed from step 6\nparallax: skipping a damaged checkpoint\n"


def test_other_ranks_say_only_what_goes_wrong(fresh: None, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    _unconfigured(monkeypatch)
    logs.configure(3)
    assert _said(capsys) == "parallax: skipping a damaged checkpoint\n"


def test_every_rank_says_everything_when_asked(fresh: None, capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    _unconfigured(monkeypatch)
    monkeypatch.setenv(logs.ALL_RANKS_ENV, "1")
    logs.configure(3)
    assert "resumed from step 6" in _said(capsys)


def test_a_programs_own_logging_is_kept(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logging.getLogger(), "handlers", [logging.NullHandler()])  # basicConfig
    logs.configure(0)
    assert logs.log.handlers == [] and logs.log.propagate  # the program's root handler serves
