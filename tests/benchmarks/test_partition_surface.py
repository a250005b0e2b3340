"""The partition surface (benchmarks/partition_surface.py, Tables 2 and 5 on one server) runs at
a tiny size: every count timed in every round, Eq. 1 fitted to the medians, the search's choice
one of the counts and scored against brute force's best, and each server step trained the
table (its rows moved)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

partition_surface = pytest.importorskip("partition_surface")


def test_every_count_is_timed_each_round_and_the_search_is_scored(tmp_path: Path) -> None:
    partition_surface.main(["--vocab", "500", "--dim", "4", "--senders", "2", "--tokens", "64",
                            "--counts", "1", "2", "4", "--steps", "4", "--rounds", "3",
                            "--search-steps", "4", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "partition-surface-lm.json").read_text())
    rows = data["brute_force"]
    assert [row["partitions"] for row in rows] == [1, 2, 4]
    assert all(len(row["seconds"]) == 3 and min(row["seconds"]) > 0 for row in rows)
    theta = data["eq1"]["theta"]
    for row in rows:  # the stored prediction is Eq. 1 at the fitted θ
        p = row["partitions"]
        assert row["eq1_s"] == pytest.approx(theta[0] + theta[1] / p + theta[2] * p)
    verdict = data["verdict"]
    assert verdict["chosen"] in {1, 2, 4} and verdict["chosen_over_best"] >= 1.0
    assert verdict["worst_over_best"] >= 1.0
    assert len(verdict["paired_chosen_over_best"]) == 3
    samples = data["search"]["samples"]
    assert samples[0]["partitions"] == 1  # the papers' start: the number of servers


def test_a_server_step_updates_the_table() -> None:
    import torch.distributed as dist

    from parallax.cluster import WorkerInfo

    args = partition_surface.parse_args(["--vocab", "50", "--dim", "3", "--tokens", "16",
                                         "--senders", "2", "--counts", "1", "3"])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        worker = WorkerInfo(rank=0, world_size=1, local_rank=0, machine=0, num_machines=1,
                            machine_of_rank=(0,))
        surface = partition_surface.Surface(args, dist.group.WORLD, worker)
        before = {count: table.full_weight().clone()
                  for count, (table, _) in surface.tables.items()}
        for count in surface.tables:
            assert surface.step(count) > 0
        for count, (table, _) in surface.tables.items():
            assert not torch.equal(table.full_weight(), before[count]), count
        surface.pool.close()
    finally:
        dist.destroy_process_group()
