"""α is measured over the warm-up steps only: afterwards the tables stop counting their use
(`Table.measuring`), so that a long run neither pays for the counting (a ``torch.unique`` of
every lookup's ids per step) nor keeps a list that grows every step."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import parallax
from parallax.engine.tables.own import OwnTable
from parallax.planning.sparsity import WHOLE_STEP_ELEMENTS


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(40, 4, mode="sum")
        self.embedding = nn.Embedding(40, 4)
        self.out = nn.Linear(4, 1)

    def forward(self, ids: Tensor) -> Tensor:
        return self.out(self.bag(ids) + self.embedding(ids).mean(dim=1)).squeeze(1)


@pytest.mark.parametrize("warmup", [0, 2])
def test_use_is_counted_over_the_warmup_only(single_process, warmup: int) -> None:
    torch.manual_seed(0)
    model = _Model()
    runner = parallax.get_runner(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                 nn.functional.mse_loss, config=parallax.Config(
                                     sparsity_warmup_steps=warmup, partition_cache=None,
                                     # α is never above 1: the tables stay on the servers
                                     # (one worker would move them to AllReduce)
                                     alpha_threshold=1.0))
    generator = torch.Generator().manual_seed(1)
    for step in range(1, 6):
        runner.step((torch.randint(40, (6, 3), generator=generator),
                     torch.rand(6, generator=generator)))
        for table in runner.layout.sparse.values():
            counted = min(step, warmup)
            assert len(table.rows_used) == counted and table.measuring == (step < warmup)
            # the embedding's rows are averaged over each row of ids: bags too
            assert table.bag_use.bags == 6 * counted, table.name
            assert not table.bag_use.rows_read_otherwise
    if warmup:
        assert all(p.alpha is not None and p.alpha > 0 for p in runner.plan.parameters
                   if p.sparse)
        # ... so the plan offers to pool the embedding's bags as the bag layer's
        reasons = {p.name: p.reason for p in runner.plan.parameters}
        assert all("pooled on an owner: " in reasons[n] for n in ("embedding.weight",
                                                                  "bag.weight"))
    parallax.shutdown()


class _Tokens(_Model):
    def forward(self, ids: Tensor) -> Tensor:  # the first id's row read alone
        rows = self.embedding(ids)
        return self.out(self.bag(ids) + rows.mean(dim=1) + rows[:, 0]).squeeze(1)


def test_rows_read_otherwise_are_no_bags(single_process) -> None:
    torch.manual_seed(0)
    model = _Tokens()
    runner = parallax.get_runner(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                 nn.functional.mse_loss, config=parallax.Config(
                                     sparsity_warmup_steps=2, partition_cache=None,
                                     alpha_threshold=1.0))
    for _ in range(2):
        runner.step((torch.randint(40, (6, 3)), torch.rand(6)))
    table = runner.layout.sparse["embedding.weight"]
    assert table.bag_use.rows_read_otherwise
    reasons = {p.name: p.reason for p in runner.plan.parameters}
    assert "pooled on an owner" not in reasons["embedding.weight"]
    assert "pooled on an owner" in reasons["bag.weight"]
    parallax.shutdown()


def test_one_worker_replicates_every_table_after_the_warmup(single_process) -> None:
    """With one worker the hybrid replicates every table once α is measured (nothing to
    exchange), updated where touched as the allreduce architecture's replicas (`allgatherv`:
    an AllReduced replica's update would read every row), still training exactly as the
    single-device program."""
    torch.manual_seed(0)
    model, reference = _Model(), _Model()
    reference.load_state_dict(model.state_dict())
    runner = parallax.get_runner(model, torch.optim.Adagrad(model.parameters(), lr=0.1),
                                 nn.functional.mse_loss, config=parallax.Config(
                                     sparsity_warmup_steps=2, partition_cache=None))
    optimizer = torch.optim.Adagrad(reference.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    try:
        for step in range(1, 5):
            ids, target = torch.randint(40, (6, 3), generator=generator), torch.rand(6)
            runner.step((ids, target))
            optimizer.zero_grad()
            nn.functional.mse_loss(reference(ids), target).backward()
            optimizer.step()
            syncs = {p.name: p.sync for p in runner.plan.parameters if p.sparse}
            assert set(syncs.values()) == ({"ps"} if step < 2 else {"allgatherv"}), syncs
        assert all("one worker: no exchange" in p.reason
                   for p in runner.plan.parameters if p.sparse)
        for (name, ours), theirs in zip(runner.model.state_dict().items(),
                                        reference.state_dict().values(), strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7, msg=name)
    finally:
        parallax.shutdown()


class _SparseAndDense(nn.Module):
    """One dense-gradient table, one ``sparse=True`` table."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(40, 4, mode="sum", sparse=True)
        self.embedding = nn.Embedding(40, 4, padding_idx=3)
        self.out = nn.Linear(4, 1)

    def forward(self, ids: Tensor) -> Tensor:
        return self.out(self.bag(ids) + self.embedding(ids).mean(dim=1)).squeeze(1)


def test_one_worker_own_loop_makes_a_dense_table_the_programs_own_parameter(
        single_process) -> None:
    """With one worker, after the warm-up, the own loop's dense-gradient table is the
    program's own parameter: ``.grad`` is autograd's whole gradient, as on one device, every
    step. A ``sparse=True`` table stays on the servers (a replica's gradient would be a
    zero-filled table each step where the program reads ``.grad``). Training equals one
    device, the gradients the program reads included."""
    torch.manual_seed(0)
    model, reference = _SparseAndDense(), _SparseAndDense()
    reference.load_state_dict(model.state_dict())
    model, optimizer = parallax.distribute(
        model, torch.optim.Adagrad(model.parameters(), lr=0.1),
        config=parallax.Config(sparsity_warmup_steps=2, partition_cache=None))
    plain = torch.optim.Adagrad(reference.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    try:
        for step in range(1, 6):
            ids, target = torch.randint(40, (6, 3), generator=generator), torch.rand(6)
            for net, opt in ((model, optimizer), (reference, plain)):
                opt.zero_grad()
                nn.functional.mse_loss(net(ids), target).backward()
                if step > 2 and net is model:  # the program's read of the table's .grad
                    ours = model.module.embedding.weight.grad
                if net is reference:
                    theirs = reference.embedding.weight.grad
                opt.step()
            if step > 2:
                assert ours is not None and not ours.is_sparse
                torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)
        plan = {p.name: p for p in model.runner.plan.parameters if p.sparse}
        assert plan["embedding.weight"].sync == "allgatherv"
        assert "one worker: no exchange" in plan["embedding.weight"].reason
        assert isinstance(model.runner.tables["embedding.weight"], OwnTable)
        assert plan["bag.weight"].sync == "ps" and "own loop" in plan["bag.weight"].reason
        for (name, ours), theirs in zip(model.state_dict().items(),
                                        reference.state_dict().values(), strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7, msg=name)
    finally:
        parallax.shutdown()


class _Large(nn.Module):
    """A table past `WHOLE_STEP_ELEMENTS` on the CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(WHOLE_STEP_ELEMENTS["cpu"] // 4 + 1, 4)
        self.out = nn.Linear(4, 1)

    def forward(self, ids: Tensor) -> Tensor:
        return self.out(self.embedding(ids).mean(dim=1)).squeeze(1)


@pytest.mark.parametrize("door", ["step", "own loop"])
@pytest.mark.parametrize("optimizer", ["Adagrad", "Adam"])
def test_one_worker_steps_a_large_table_by_its_touched_rows_where_untouched_rows_do_not_move(
        single_process, door: str, optimizer: str) -> None:
    """A table too large for a cheap whole step, under an optimizer that leaves a row with a
    zero gradient as it is (Adagrad), keeps its touched-rows update (a replica under
    `Runner.step`, the servers in the own loop); under Adam every row moves each step anyway,
    so it is the program's own. Either way training equals one device."""
    torch.manual_seed(0)
    model, reference = _Large(), _Large()
    reference.load_state_dict(model.state_dict())
    make = getattr(torch.optim, optimizer)
    config = parallax.Config(sparsity_warmup_steps=1, partition_cache=None)
    plain = make(reference.parameters(), lr=0.1)
    if door == "step":
        runner = parallax.get_runner(model, make(model.parameters(), lr=0.1),
                                     nn.functional.mse_loss, config=config)
    else:
        distributed, ours = parallax.distribute(model, make(model.parameters(), lr=0.1),
                                                config=config)
        runner = distributed.runner
    generator = torch.Generator().manual_seed(1)
    try:
        for _ in range(3):
            ids = torch.randint(model.embedding.num_embeddings, (6, 3), generator=generator)
            target = torch.rand(6)
            if door == "step":
                runner.step((ids, target))
            else:
                ours.zero_grad()
                nn.functional.mse_loss(distributed(ids), target).backward()
                ours.step()
            plain.zero_grad()
            nn.functional.mse_loss(reference(ids), target).backward()
            plain.step()
        table = runner.tables["embedding.weight"]
        assert isinstance(table, OwnTable) == (optimizer == "Adam")
        assert table.on_servers == (optimizer == "Adagrad" and door == "own loop")
        for (name, mine), theirs in zip(runner.state_dict().items(),
                                        reference.state_dict().values(), strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7, msg=name)
    finally:
        parallax.shutdown()
