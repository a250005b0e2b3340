"""The cost-model extrapolation (benchmarks/extrapolate.py): its fit recovers a model it was
given exactly, the held-out point is predicted from the others, and its byte model follows
the shapes as Table 3 says (the engine-plan match runs in test_benchmarks' scaling smoke)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

extrapolate = pytest.importorskip("extrapolate")
from parallax.planning.cost import Shape  # noqa: E402

CFG = extrapolate.LMConfig(vocab=2000, seq_len=5, batch=4)
TRUE = extrapolate.Fit({"hybrid": 0.04, "ps": 0.05, "allreduce": 0.2}, 5e-9,
                       {"hybrid": 0.002, "ps": 0.003, "allreduce": 0.001})


def measured_points(cores: int) -> tuple[list, dict]:
    used = extrapolate.rows_used(CFG, 1)  # as analyse() counts them
    costs = extrapolate.parameter_costs(CFG, used)
    bytes_of, points = {}, []
    for system in extrapolate.SYSTEMS:
        for machines in (1, 2, 4, 8):
            b = extrapolate.predicted_bytes(system, costs, Shape(machines, 1))
            bytes_of[system, machines, 1] = b
            points.append(extrapolate.Point(system, machines, 1,
                                            TRUE.step_s(system, machines, b, cores)))
    return points, bytes_of


def test_fit_recovers_the_parameters_it_was_generated_with():
    points, bytes_of = measured_points(cores=2)
    got = extrapolate.fit(points, bytes_of, cores=2)
    assert got.seconds_per_byte == pytest.approx(TRUE.seconds_per_byte, rel=1e-6)
    for system in extrapolate.SYSTEMS:
        assert got.compute_s[system] == pytest.approx(TRUE.compute_s[system], rel=1e-6)
        assert got.per_peer_s[system] == pytest.approx(TRUE.per_peer_s[system], rel=1e-6)


def test_held_out_point_and_predictions():
    points, _ = measured_points(cores=2)
    result = extrapolate.analyse(points, CFG, cores=2, machines=[16], workers=[1, 8])
    held = [r for r in result["measured"] if r["held_out"]]
    assert {r["machines"] for r in held} == {8} and len(held) == 3
    for r in result["measured"]:
        assert abs(r["validation_error"]) < 1e-6 and abs(r["final_error"]) < 1e-6
    for row in result["predictions"]:  # one core per worker: no compute share
        for system in extrapolate.SYSTEMS:
            b = row[system]["bytes"]
            world = row["machines"] * row["workers"]
            assert row[system]["step_s"] == pytest.approx(
                TRUE.step_s(system, world, b, None), rel=1e-6)
    assert "held out" in extrapolate.markdown(result, "synthetic")


def test_bytes_follow_table_3():
    used = extrapolate.rows_used(CFG, 8, steps=3)
    costs = extrapolate.parameter_costs(CFG, used)
    for table, (per_worker, per_machine) in used.items():
        assert per_worker <= per_machine <= 8 * per_worker, table
    # one worker per machine: PS payload per machine grows as (N-1)/N (x 1.875 from 2 to 16
    # machines), plus 24-byte count messages to every rank
    ps = [extrapolate.predicted_bytes("ps", costs, Shape(n, 1)) for n in (2, 4, 16)]
    assert ps[0] < ps[1] < ps[2] < 1.875 * ps[0] * 1.05
    # AllGatherv grows with the world: every worker's rows to every other worker (W - 1 = 7
    # peers on 8 machines against 1 on 2)
    tables = {name: c for name, c in costs.items() if c.sparse}
    ag = [extrapolate.predicted_bytes("allreduce", tables, Shape(n, 1)) for n in (2, 8)]
    assert ag[1] == pytest.approx(7 * ag[0], rel=1e-12)
    # eight workers per machine: the hybrid never moves more than the plain PS
    for n in (2, 16, 256):
        shape = Shape(n, 8)
        assert (extrapolate.predicted_bytes("hybrid", costs, shape)
                <= extrapolate.predicted_bytes("ps", costs, shape))
