"""The paired-ratio summary (benchmarks/ratios.py): each round's ratio pairs the two systems of
that round, a sitting's interval holds its geometric mean, and a record without a system or
with unpaired rounds is refused by name."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

ratios = pytest.importorskip("ratios")


def record(system: str, steps: list[float], commit: str = "abcdef0123") -> dict:
    return {"system": system, "median_step_s": sorted(steps)[len(steps) // 2],
            "provenance": {"commit": commit},
            "repeats": [{"median_step_s": s} for s in steps]}


def test_each_round_pairs_the_two_systems_of_that_round() -> None:
    sitting = ratios.paired_rounds(
        [record("hybrid", [0.010, 0.020, 0.040]), record("torchrec-tw", [0.012, 0.020, 0.030])],
        "hybrid", "torchrec-tw", "x.json")
    assert sitting.ratios == pytest.approx((1.2, 1.0, 0.75))
    assert sitting.commit == "abcdef0"
    assert sitting.geomean == pytest.approx((1.2 * 1.0 * 0.75) ** (1 / 3))
    low, high = ratios.interval(sitting.ratios)
    assert low < sitting.geomean < high


def test_pooled_intervals_over_sittings_and_over_rounds() -> None:
    a = ratios.Sitting("a", "1", (1.1, 1.3))
    b = ratios.Sitting("b", "2", (0.9, 0.9, 1.0))
    summary = ratios.pooled([a, b])
    assert summary["sittings"] == 2 and summary["rounds"] == 5
    assert summary["rounds_ours_faster"] == 2
    assert summary["geomean_of_sittings"] == pytest.approx(
        math.sqrt(a.geomean * b.geomean))
    assert summary["geomean_of_rounds"] == pytest.approx(
        (1.1 * 1.3 * 0.9 * 0.9 * 1.0) ** (1 / 5))
    # two sittings far apart: wide over sittings; a single sitting gives no interval
    low, high = summary["interval_over_sittings"]
    assert low < 1.0 < high
    assert ratios.interval((1.2,)) is None
    assert "**pooled**" in ratios.markdown([a, b], summary, "hybrid", "torchrec-tw")


def test_a_missing_system_or_unpaired_rounds_are_refused_naming_the_record() -> None:
    with pytest.raises(SystemExit, match="x.json: no system 'torchrec-rw'"):
        ratios.paired_rounds([record("hybrid", [0.01])], "hybrid", "torchrec-rw", "x.json")
    with pytest.raises(SystemExit, match="y.json: hybrid ran 2 rounds, ps 1"):
        ratios.paired_rounds([record("hybrid", [0.01, 0.02]), record("ps", [0.01])],
                             "hybrid", "ps", "y.json")
