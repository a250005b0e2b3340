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


class _Counted(nn.Module):
    """An embedding model whose forward keeps a counter on itself (state a forward sets)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(30, 4)
        self.out = nn.Linear(12, 1)
        self.calls = 0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.out(self.emb(ids).flatten(1))


@pytest.mark.parametrize("dense_sync", ["hierarchical", "qsgd"])
def test_after_the_warm_up_one_worker_runs_the_programs_own_module(
        single_process, dense_sync: str) -> None:
    """With every table the program's own and no DDP, the forward is the program's module
    itself (`ProgramForward`): its layers call their own ``forward``, a hook registered
    after `distribute` and the program's own call of a layer in the loop run as on one
    device, and the parameters equal the plain loop's (float64). Under ``qsgd`` (DDP with a
    hook that changes the gradient) the executed copy keeps running."""
    from parallax.step.forward import Forward, ProgramForward

    torch.manual_seed(0)
    mine = _Counted().double()
    plain = _Counted().double()
    plain.load_state_dict(mine.state_dict())
    model, opt = parallax.distribute(mine, torch.optim.SGD(mine.parameters(), lr=0.1,
                                                           momentum=0.9),
                                     config=parallax.Config(sparsity_warmup_steps=2,
                                                            dense_sync=dense_sync,
                                                            partition_cache=None))
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    hooked: list[int] = []
    mine.emb.register_forward_hook(lambda module, args, out: hooked.append(out.shape[0]))
    generator = torch.Generator().manual_seed(1)
    try:
        for _ in range(6):
            ids = torch.randint(30, (5, 3), generator=generator)
            target = torch.rand(5, 1, generator=generator, dtype=torch.float64)
            for net, layer, optimizer in ((model, mine.emb, opt), (plain, plain.emb, plain_opt)):
                optimizer.zero_grad()
                loss = nn.functional.mse_loss(net(ids), target)
                (loss + 0.01 * layer(ids[:, 0]).pow(2).mean()).backward()
                optimizer.step()
        runs_program = dense_sync == "hierarchical"
        forward = model.runner.forward_pass
        assert isinstance(forward, ProgramForward if runs_program else Forward)
        assert ("forward" not in mine.emb.__dict__) == runs_program
        assert mine.calls == plain.calls == 6
        assert hooked == [5, 5] * 6  # the model's lookup and the loop's own call, each step
        if runs_program:  # exact: the single-device program's own step
            for (name, ours), theirs in zip(model.state_dict().items(),
                                            plain.state_dict().values(), strict=True):
                torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-9, msg=name)
    finally:
        parallax.shutdown()


def test_one_worker_keeps_the_copy_while_a_table_is_on_the_servers(single_process) -> None:
    """A large table under Adagrad in the program's own loop stays on the one server (its
    touched rows are cheaper than a whole step): the executed copy keeps running."""
    from parallax.step.forward import Forward

    torch.manual_seed(0)
    mine = nn.Sequential(nn.Embedding(200_000, 4), nn.Flatten(), nn.Linear(12, 1))
    model, opt = parallax.distribute(mine, torch.optim.Adagrad(mine.parameters(), lr=0.1),
                                     config=parallax.Config(sparsity_warmup_steps=1,
                                                            partition_cache=None))
    try:
        for _ in range(2):
            opt.zero_grad()
            nn.functional.mse_loss(model(torch.randint(200_000, (5, 3))),
                                   torch.rand(5, 1)).backward()
            opt.step()
        assert model.runner.tables["0.weight"].on_servers
        assert type(model.runner.forward_pass) is Forward
    finally:
        parallax.shutdown()
