"""Emulated networks set up side by side never share a subnet: each run claims its third octet
by a file made whole at once; a claim whose process is gone is taken over (no root needed:
only the claim files are exercised)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from parallax.errors import NetemError
from parallax.launch import netem


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(netem, "STATE_DIR", tmp_path)
    return tmp_path


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_two_runs_from_one_first_choice_get_two_subnets(state: Path) -> None:
    first = netem.claim_subnet(7, "aaaaaa")
    second = netem.claim_subnet(7, "bbbbbb")
    assert (first, second) == (7, 8)
    assert (state / "net-7").read_text() == f"{os.getpid()} aaaaaa"
    assert not [p for p in state.iterdir() if p.name.startswith(".")]  # no temporary left
    netem.remove_run("aaaaaa")  # its claim goes with it; the other run's stays
    assert not (state / "net-7").exists() and (state / "net-8").exists()
    assert netem.claim_subnet(7, "cccccc") == 7


def test_a_dead_runs_claim_is_taken_over_and_cleaned(state: Path) -> None:
    (state / "net-3").write_text(f"{dead_pid()} dddddd")
    assert netem.claim_subnet(3, "eeeeee") == 3
    (state / "net-4").write_text(f"{dead_pid()} ffffff")
    netem.clean_stale_runs()
    assert not (state / "net-4").exists() and (state / "net-3").exists()


def test_every_subnet_held_is_refused_with_where_the_claims_are(
        state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netem, "SUBNETS", 3)
    for net in (1, 2, 3):
        (state / f"net-{net}").write_text(f"{os.getpid()} run{net}")
    with pytest.raises(NetemError, match=f"held by a running emulated network.*{state}"):
        netem.claim_subnet(2, "gggggg")
