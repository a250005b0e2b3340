"""The exchange's collectives on 2 machines x 2 workers (tests/scripts/collectives_worker.py).

Sums over all ranks: small payloads go by one all_to_all, large ones machine by machine; either
way every rank holds bitwise the same sum, close to the exact one, and the bytes counted are
the cost model's. Pulls whose ids go with the count message (from a table that rank 0 scattered
in many rounds): exactly the table's rows whatever the counts do (none, steady, bursts past the
reserved room), one all_to_all to open where the room holds the ids and two where it does not,
and a bad id on one rank fails every rank with the same error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from parallax.engine.tables import reduction
from parallax.planning import cost

ROOT = Path(__file__).resolve().parents[2]
WORLD, MACHINES = 4, 2


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("collectives")
    cmd = [sys.executable, "-m", "parallax.cli", "run", "--machines", str(MACHINES),
           "--nproc-per-machine", "2", str(ROOT / "tests" / "scripts" / "collectives_worker.py"),
           str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [torch.load(out / f"rank{rank}.pt") for rank in range(WORLD)]


@pytest.fixture(scope="module")
def sums(records) -> list[dict]:
    return [record["sums"] for record in records]


@pytest.fixture(scope="module")
def pulls(records) -> list[dict]:
    return [record["pulls"] for record in records]


def test_small_payloads_go_by_one_all_to_all_and_large_ones_by_rings(sums) -> None:
    schemes = {case: record["by_all_to_all"] for case, record in sums[0].items()}
    assert schemes == {"tiny-float32": True, "tiny-float64": True, "small-float32": True,
                       "small-float64": False, "large-float32": False,
                       "large-float64": False}
    for case, record in sums[0].items():  # the rule the plan uses decides alike
        size = record["sum"].numel() * record["sum"].element_size()
        assert reduction.small(size, WORLD) is record["by_all_to_all"], case


def test_every_rank_holds_bitwise_the_same_sum_close_to_the_exact_one(sums) -> None:
    for case, record in sums[0].items():
        for rank in range(1, WORLD):
            assert torch.equal(sums[rank][case]["sum"], record["sum"]), (case, rank)
        # rounding: the cast and W - 1 additions, each within eps of the magnitudes' sum
        eps = torch.finfo(record["sum"].dtype).eps
        error = (record["sum"].double() - record["exact"]).abs()
        assert bool((error <= WORLD * eps * record["bound"]).all()), case


def test_counted_bytes_are_the_cost_models(sums) -> None:
    shape = cost.Shape(MACHINES, WORLD // MACHINES, small_sums=True)
    for case in sums[0]:
        inter = sum(record[case]["bytes"].get(key, 0) for record in sums
                    for key in ("inter_sent", "inter_received"))
        size = sums[0][case]["sum"].numel() * sums[0][case]["sum"].element_size()
        assert inter / MACHINES == pytest.approx(cost.allreduce_dense(size, shape)), case


def test_pulls_return_the_tables_rows_whatever_the_counts_do(pulls) -> None:
    for rank, record in enumerate(pulls):
        assert all(record["exact"]), (rank, record["exact"])


def test_a_pull_opens_in_one_all_to_all_where_the_room_holds_its_ids(pulls) -> None:
    opened = pulls[0]["collectives"]  # the same on every rank: they agree on a second round
    assert all(record["collectives"] == opened for record in pulls)
    # (steps: ids per lookup 0, then 60 x 3 consecutive, 60 random, a burst of 300, 20,
    # 20, 0, 400, 400, 10 random)
    assert opened[0] == 1  # nothing to send
    assert opened[1] == 2  # the first ids: no room reserved yet
    assert opened[2] == opened[3] == opened[4] == 1  # steady counts, then alike at random
    assert opened[5] == 2 and opened[9] == 2  # bursts past the most seen
    assert opened[6] == opened[7] == opened[8] == opened[10] == opened[11] == 1


def test_a_bad_id_on_one_rank_fails_every_rank_alike(pulls) -> None:
    errors = {record["error"] for record in pulls}
    assert len(errors) == 1
    (error,) = errors
    assert error is not None and "id 505 on rank 1" in error
