"""The partition-count search inside training (issue 5): partitioners mark the tables, the
runner samples counts on the user's own steps, re-partitions in process, applies the fitted
best count, caches it, and the plan shows it."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import parallax
from parallax.engine.tables.pool import PartitionPool
from parallax.partitions.cache import cache_key, load_entry, store_entry
from parallax.partitions.groups import group_of
from parallax.step import round as round_module

ROOT = Path(__file__).resolve().parents[2]
SEARCH_WORKER = ROOT / "tests" / "scripts" / "search_worker.py"


# ---- marking tables ----------------------------------------------------------------------------
def test_partitioner_tags_what_is_created_inside_and_nothing_else() -> None:
    before = nn.Embedding(10, 2)
    with parallax.partitioner("outer") as outer:
        first = nn.Embedding(10, 2)
        with parallax.partitioner("inner", max_partitions=3) as inner:
            second = nn.Linear(2, 2)
        third = nn.Embedding(10, 2)
    after = nn.Embedding(10, 2)
    assert group_of(before.weight) is None and group_of(after.weight) is None
    assert group_of(first.weight) == group_of(third.weight) == outer
    assert group_of(second.weight) == group_of(second.bias) == inner
    assert inner.max_partitions == 3 and outer.max_partitions is None


def test_partition_call_marks_modules_parameters_and_lists() -> None:
    model = nn.Sequential(nn.Embedding(10, 2), nn.Linear(2, 2))
    extra = nn.Parameter(torch.zeros(4, 2))
    group = parallax.partition([model[0], extra], name="tables")
    assert group_of(model[0].weight) == group_of(extra) == group
    assert group_of(model[1].weight) is None
    with pytest.raises(TypeError, match="modules and parameters, got Tensor"):
        parallax.partition([torch.zeros(2)])
    with pytest.raises(ValueError, match="max_partitions must be None or an int >= 1"):
        parallax.partition(model, max_partitions=0)
    with pytest.raises(ValueError, match="non-empty str"):
        parallax.partitioner("").__enter__()


# ---- the pool ----------------------------------------------------------------------------------
def test_pool_runs_every_task_and_reraises_after_all_ended() -> None:
    pool = PartitionPool(3)
    done: list[int] = []

    def fail() -> None:
        raise RuntimeError("partition 1 failed")

    tasks = [lambda: done.append(0), fail, lambda: done.append(2)]
    with pytest.raises(RuntimeError, match="partition 1 failed"):
        pool.run(tasks)
    assert sorted(done) == [0, 2]
    pool.close()
    with pytest.raises(ValueError, match="at least 1"):
        PartitionPool(0)


# ---- the search in a single-process runner, with a clock that follows a known curve ---------
class CurveClock:
    """``time.perf_counter`` for the step round: each step lasts t(P) of the table's current P."""

    def __init__(self, table_of, curve) -> None:
        self.table_of, self.curve, self.now, self.calls = table_of, curve, 0.0, 0

    @staticmethod
    def monotonic() -> float:  # the runner's checkpoint clock: not under test here
        return 0.0

    def perf_counter(self) -> float:
        self.calls += 1
        if self.calls % 2 == 0:  # the end of a step
            self.now += self.curve(self.table_of().partitioning.num_partitions)
        return self.now


def lm() -> nn.Module:
    torch.manual_seed(0)
    with parallax.partitioner("tables", max_partitions=16):
        embedding = nn.Embedding(64, 4)
    return nn.Sequential(embedding, nn.Flatten(), nn.Linear(8, 1))


def train(config: parallax.Config, steps: int, curve=None, monkeypatch=None):
    model = lm()
    reference = lm()
    runner = parallax.get_runner(model, torch.optim.Adagrad(model.parameters(), lr=0.1),
                                 nn.functional.mse_loss, config=config)
    try:
        if curve is not None:
            clock = CurveClock(lambda: runner.tables["0.weight"], curve)
            monkeypatch.setattr(round_module, "time", clock)
        optimizer = torch.optim.Adagrad(reference.parameters(), lr=0.1)
        generator = torch.Generator().manual_seed(1)
        for _ in range(steps):
            ids, target = torch.randint(64, (5, 2), generator=generator), torch.rand(5, 1)
            runner.step((ids, target))
            optimizer.zero_grad()
            nn.functional.mse_loss(reference(ids), target).backward()
            optimizer.step()
        trained = runner.state_dict()
        return runner, trained, reference.state_dict()
    finally:
        parallax.shutdown()


def test_search_samples_the_users_steps_fits_and_applies_the_best_count(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "partitions.json"
    config = parallax.Config(sparsity_warmup_steps=2, partition_search_steps=4,
                             partition_cache=str(cache), server_threads=2,
                             alpha_threshold=1.0)  # on the servers at one worker
    # t(P) = 1 + 16/P + P: best at P = 4. One server: start 1, double while faster: 1 2 4 8.
    runner, trained, want = train(config, 2 + 4 * 4 + 3, lambda p: 1 + 16 / p + p,
                                  monkeypatch)
    record = runner.partition_searches["tables"]
    assert [s.partitions for s in record.samples] == [1, 2, 4, 8]
    assert [s.seconds for s in record.samples] == pytest.approx([18, 11, 9, 11])
    assert record.theta == pytest.approx((1, 16, 1))
    assert record.partitions == 4 and record.source == "searched"
    assert runner.tables["0.weight"].partitioning.num_partitions == 4
    assert [p.partitions for p in runner.plan.parameters if p.sparse] == [4]
    assert "partition group 'tables' (0.weight): P=4, searched" in runner.plan.table()
    assert json.loads(runner.plan.to_json())["partition_searches"][0]["partitions"] == 4
    # Four re-partitions in the middle of training changed nothing.
    for name, value in want.items():
        torch.testing.assert_close(trained[name], value, msg=name)
    # The next run of the same job takes the count from the cache and samples nothing.
    again, trained, want = train(config, 4)
    cached = again.partition_searches["tables"]
    assert cached.source == "cache" and cached.partitions == 4
    assert [s.partitions for s in cached.samples] == [1, 2, 4, 8]
    assert again.tables["0.weight"].partitioning.num_partitions == 4
    assert "from the partition cache" in again.plan.table()
    for name, value in want.items():
        torch.testing.assert_close(trained[name], value, msg=name)


def test_without_a_partitioner_nothing_is_searched(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(64, 4), nn.Flatten(), nn.Linear(8, 1))
    runner = parallax.get_runner(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                 nn.functional.mse_loss,
                                 config=parallax.Config(num_partitions=3, sparsity_warmup_steps=1,
                                                        partition_cache=str(tmp_path / "c"),
                                                        alpha_threshold=1.0))  # on the servers
    try:
        for _ in range(4):
            runner.step((torch.randint(64, (5, 2)), torch.rand(5, 1)))
        assert runner.partition_searches == {}
        assert runner.tables["0.weight"].partitioning.num_partitions == 3
        assert not (tmp_path / "c").exists()
    finally:
        parallax.shutdown()


# ---- the cache file ------------------------------------------------------------------------
def test_cache_survives_a_damaged_file_and_keys_on_the_signature(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "sub" / "partitions.json"
    key = cache_key({"machines": 2, "parameters": [["w", [10, 2], "torch.float32"]]})
    assert key != cache_key({"machines": 3, "parameters": [["w", [10, 2], "torch.float32"]]})
    assert load_entry(path, key) is None
    store_entry(path, key, {"partitions": 6})
    assert load_entry(path, key) == {"partitions": 6}
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="parallax"):
        assert load_entry(path, key) is None
        store_entry(path, "other", {"partitions": 2})
    assert "unreadable partition cache" in caplog.text and str(path) in caplog.text
    assert json.loads(path.read_text()) == {"other": {"partitions": 2}}
    assert list(path.parent.iterdir()) == [path]  # no temporary files left behind


def test_config_checks_the_search_fields() -> None:
    for field, value, expected in (("partition_search_steps", 1, "an int >= 2"),
                                   ("server_threads", 0, "None or an int >= 1"),
                                   ("max_partitions", 2.5, "None or an int >= 1"),
                                   ("partition_cache", "", "None or a file path")):
        with pytest.raises(parallax.ConfigError, match=f"Config.{field} must be {expected}"):
            parallax.Config(**{field: value})
    assert parallax.Config(partition_cache=Path("/tmp/x.json")).partition_cache == "/tmp/x.json"


# ---- across processes: plan shows the search, the next run reads the cache -------------------
def test_plan_runs_the_search_and_the_next_run_uses_its_cache(tmp_path: Path) -> None:
    cache, out = tmp_path / "partitions.json", tmp_path / "searches.json"
    plan = tmp_path / "plan.json"
    cmd = [sys.executable, "-m", "parallax.cli", "plan", "--machines", "2",
           "--nproc-per-machine", "1", "--warmup-steps", "2", "--json", str(plan),
           str(SEARCH_WORKER), str(cache), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert not out.exists(), "plan must stop once the search is done"
    assert "partition group 'embeddings' (0.weight): P=" in proc.stdout
    assert "partition search 'embeddings': P=2" in proc.stderr  # progress, one line per sample
    (searched,) = json.loads(plan.read_text())["partition_searches"]
    assert searched["samples"][0]["partitions"] == 2  # two servers
    assert 1 <= searched["partitions"] <= 8
    entry = json.loads(cache.read_text())
    assert [e["partitions"] for e in entry.values()] == [searched["partitions"]]
    cmd[3] = "run"
    del cmd[8:12]  # --warmup-steps 2 --json plan.json
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    record = json.loads(out.read_text())["embeddings"]
    assert record["source"] == "cache" and record["partitions"] == searched["partitions"]
    assert "partition search 'embeddings': P=" not in proc.stderr  # nothing sampled
