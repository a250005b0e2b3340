"""A world of one has nothing to exchange: the dense sync runs no DDP wrapper where its hook
would only sum one gradient with itself, and the step's gradients are the program's own
(`parallax.engine.dense_sync.SUMS_EXACTLY`). A hook that changes even one worker's gradient
(``qsgd`` quantises it) still runs."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import parallax


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(30, 4), nn.Flatten(), nn.Linear(12, 1))


@pytest.mark.parametrize(("dense_sync", "wrapped"),
                         [("hierarchical", False), ("flat", False), ("qsgd", True)])
def test_one_worker_runs_ddp_only_where_its_hook_changes_the_gradient(
        single_process, dense_sync: str, wrapped: bool) -> None:
    model, reference = _model(), _model()
    runner = parallax.get_runner(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                 nn.functional.mse_loss,
                                 config=parallax.Config(dense_sync=dense_sync,
                                                        partition_cache=None))
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    try:
        assert isinstance(runner.module, DistributedDataParallel) == wrapped
        for _ in range(3):
            ids, target = torch.randint(30, (5, 3), generator=generator), torch.rand(5, 1)
            runner.step((ids, target))
            plain.zero_grad()
            nn.functional.mse_loss(reference(ids), target).backward()
            plain.step()
        if not wrapped:  # exact: the single-device program's own step
            for (name, ours), theirs in zip(runner.state_dict().items(),
                                            reference.state_dict().values(), strict=True):
                torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-7, msg=name)
    finally:
        parallax.shutdown()


@pytest.mark.parametrize("bad", [-1, 30])
def test_one_workers_own_table_names_an_id_outside_it(single_process, bad: int) -> None:
    """After the warm-up the table is the program's own, and an id outside it is still
    named as on the servers (`SparseIdError`, an ``IndexError``), not torch's bare message."""
    from parallax.engine.tables.own import OwnTable

    model = _model()
    runner = parallax.get_runner(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                 nn.functional.mse_loss,
                                 config=parallax.Config(sparsity_warmup_steps=1,
                                                        partition_cache=None))
    try:
        runner.step((torch.randint(30, (5, 3)), torch.rand(5, 1)))
        assert isinstance(runner.tables["0.weight"], OwnTable)
        ids = torch.randint(30, (5, 3))
        ids[2, 1] = bad
        with pytest.raises(parallax.SparseIdError,
                           match=rf"'0.weight' got id {bad} on rank 0 .*\[0, 30\)"):
            runner.step((ids, torch.rand(5, 1)))
    finally:
        parallax.shutdown()
