"""A table the hybrid moved to AllReduce on several workers is the program's own parameter,
its gradient summed over them (`parallax.engine.tables.own_summed`): the own loop's habits
around it (several backward passes a step, ``zero_grad(set_to_none=False)``, ``.grad`` read
between backward and step) train as on one device, and an id outside it on one rank fails
every rank alike, the run going on after."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from equivalence_cases import Case, Mixed, global_batches, loss_fn  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "scripts" / "summed_own_worker.py"
STEPS = 6
WARMUP = 2  # the worker's: steps on the servers before the move


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("summed_own")
    proc = subprocess.run([sys.executable, "-m", "parallax.cli", "run", "--machines", "1",
                           "--nproc-per-machine", "2", str(WORKER), str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _single_device() -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = Mixed().double()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    batches = global_batches(Case("mixed", "adam", steps=STEPS + 1))
    grads = []
    for step, (x, y) in enumerate(batches[:STEPS], 1):
        optimizer.zero_grad(set_to_none=step % 2 == 1)
        # each worker's two halves: the global batch's quarters, in the same pairs
        quarter = x.shape[0] // 4
        for q in range(2):
            parts = [slice(w * 2 * quarter + q * quarter, w * 2 * quarter + (q + 1) * quarter)
                     for w in range(2)]
            xs, ys = torch.cat([x[p] for p in parts]), torch.cat([y[p] for p in parts])
            (loss_fn(model(xs), ys) / 2).backward()
        if step > WARMUP:
            grads.append(model.embedding.weight.grad.detach().clone())
        optimizer.step()
    x, y = batches[STEPS]
    for _ in range(2):  # the worker's profiled step, and its step after the bad ids
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()
    return grads, model.state_dict()


def test_the_moved_tables_are_the_programs_own_summed_over_the_workers(ranks) -> None:
    for record in ranks:
        assert record["kinds"] == ["ShardedTable", "SummedOwnTable"]  # before and after moving


def test_accumulated_backward_passes_train_as_on_one_device(ranks) -> None:
    grads, state = _single_device()
    for record in ranks:
        for got, want in zip(record["grads"], grads, strict=True):  # .grad as the loop reads it
            assert float((got - want).abs().max()) <= 1e-9 * float(want.abs().max())
        for name, want in state.items():
            got = record["state"][name]
            assert float((got - want).abs().max()) <= 1e-9 * float(want.abs().max()), name


def test_a_bad_id_on_one_rank_fails_every_rank_alike(ranks) -> None:
    # in a forward (its look-ahead's agreement) and in the program's own call of the layer
    # (the lookup's own)
    for call in range(2):
        errors = {record["errors"][call] for record in ranks}
        assert len(errors) == 1
        (error,) = errors
        assert error is not None and "'embedding.weight' got id 1000000 on rank 1" in error


def test_a_step_of_the_moved_tables_meets_three_times_beyond_the_dense_sync(ranks) -> None:
    """The forward's one collective is its loop-order check, carrying both tables' bad-id
    flags; then the dense AllReduce, the moved tables' one AllReduce and the update's order
    check: nothing per table, no finiteness check (every gradient is whole everywhere)."""
    for record in ranks:
        counted = record["collectives"]
        assert counted["forward"] == ["c10d::_allgather_base_"], counted
        assert len(counted["backward and step"]) == 3, counted
