"""Lookup options parallax cannot make exact are refused at `get_runner`, naming the parameter
and the option; those it makes exact keep every replica equal (the equivalence matrix checks
the values against one device: `equivalence_cases.OPTION_MODELS`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import parallax

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 12


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(output, target)


def runner_for(model: nn.Module, **config) -> parallax.Runner:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return parallax.get_runner(model, optimizer, loss_fn, config=parallax.Config(**config))


@pytest.fixture(autouse=True)
def _shutdown():
    yield
    parallax.shutdown()


class Tied(nn.Module):
    def __init__(self, **options) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, 4, **options)
        self.decoder = nn.Linear(4, VOCAB)
        self.decoder.weight = self.embedding.weight

    def forward(self, ids: Tensor) -> Tensor:
        return self.decoder(self.embedding(ids).mean(dim=1))


@pytest.mark.parametrize("options, described", [
    ({"max_norm": 1.0}, "max_norm=1.0"),
    ({"scale_grad_by_freq": True}, "scale_grad_by_freq=True"),
    ({"max_norm": 2.0, "norm_type": 1.0}, "max_norm=2.0, norm_type=1.0"),
])
def test_tied_weight_with_batch_dependent_option_is_refused(options: dict,
                                                            described: str) -> None:
    with pytest.raises(ValueError, match=rf"parameter 'embedding.weight' is looked up with "
                                         rf"{described} \(embedding\), but it is also read "
                                         r"outside its lookups \(tied or re-used\)"):
        runner_for(Tied(**options))


class Frozen(nn.Module):
    def __init__(self, **options) -> None:
        super().__init__()
        self.embedding = nn.Embedding.from_pretrained(torch.randn(VOCAB, 4) * 3, **options)
        self.out = nn.Linear(4, 3)

    def forward(self, ids: Tensor) -> Tensor:
        return self.out(self.embedding(ids).mean(dim=1))


def test_frozen_table_with_max_norm_is_refused_and_with_freq_allowed() -> None:
    with pytest.raises(ValueError, match=r"'embedding.weight' is looked up with max_norm=1.0 "
                                         r"\(embedding\), but it is frozen"):
        runner_for(Frozen(max_norm=1.0))
    runner = runner_for(Frozen(scale_grad_by_freq=True))  # no gradient: nothing to scale
    runner.step((torch.tensor([[1, 2, 2]]), torch.tensor([0])))


class Functional(nn.Module):
    def __init__(self, bag: bool) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(VOCAB, 4))
        self.bag = bag

    def forward(self, ids: Tensor) -> Tensor:
        if self.bag:
            return F.embedding_bag(ids, self.w, max_norm=1.0)[:, :3]
        return F.embedding(ids, self.w, max_norm=1.0).mean(dim=1)[:, :3] + self.w.sum()


@pytest.mark.parametrize("bag", [False, True])
def test_functional_lookup_of_a_dense_parameter_with_max_norm_is_refused(bag: bool) -> None:
    where = "F.embedding_bag" if bag else "F.embedding"
    with pytest.raises(ValueError, match=rf"'w' is looked up with max_norm=1.0 \({where}\)"):
        runner_for(Functional(bag))


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag_scale_grad_by_freq_is_refused_citing_torch(mode: str) -> None:
    class Bag(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bag = nn.EmbeddingBag(VOCAB, 3, mode=mode, scale_grad_by_freq=True)

        def forward(self, ids: Tensor) -> Tensor:
            return self.bag(ids)

    with pytest.raises(ValueError, match=r"parameter 'bag.weight': nn.EmbeddingBag\("
                                         r"scale_grad_by_freq=True\) at 'bag'.*#190063"):
        runner_for(Bag())


def test_scale_grad_by_freq_with_sparse_gradients_is_refused_as_torch_does() -> None:
    with pytest.raises(RuntimeError, match="scale_grad_by_freq not supported with sparse"):
        F.embedding(torch.tensor([1, 1]), torch.randn(VOCAB, 2, requires_grad=True),
                    scale_grad_by_freq=True, sparse=True).sum().backward()
    model = Frozen()
    model.embedding = nn.Embedding(VOCAB, 4, scale_grad_by_freq=True, sparse=True)
    with pytest.raises(ValueError, match=r"parameter 'embedding.weight': "
                                         r"scale_grad_by_freq=True with sparse gradients"):
        runner_for(model)
    model.embedding = nn.Embedding(VOCAB, 4, scale_grad_by_freq=True)
    with pytest.raises(ValueError, match="lazy_sparse_updates"):
        runner_for(model, lazy_sparse_updates=True)


def test_frequency_scaled_table_looked_up_twice_in_a_step_is_refused() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding = nn.Embedding(VOCAB, 3, scale_grad_by_freq=True)

        def forward(self, ids: Tensor) -> Tensor:
            return (self.embedding(ids) + self.embedding(ids.flip(1))).mean(dim=1)

    for architecture in ("hybrid", "allreduce"):
        runner = runner_for(Twice(), architecture=architecture)
        with pytest.raises(parallax.UnsupportedProgramError,
                           match=r"rank 0: parameter 'embedding.weight' has "
                                               r"scale_grad_by_freq=True and was looked up a "
                                               r"second time in one step"):
            runner.step((torch.tensor([[1, 2, 2]]), torch.tensor([0])))
        runner.evaluate([(torch.tensor([[1, 2, 2]]), torch.tensor([0]))])  # no gradient: fine
        parallax.shutdown()


def test_max_norm_replicas_stay_bitwise_equal(tmp_path: Path) -> None:
    """Replicated max_norm tables (allreduce architecture; the hybrid after moving them to
    AllReduce) on 2 machines x 2 workers: after every step each rank's replica is
    bitwise equal to rank 0's, and training changed it."""
    cmd = [sys.executable, "-m", "parallax.cli", "run", "--machines", "2",
           "--nproc-per-machine", "2", str(ROOT / "tests" / "scripts" / "replica_worker.py"),
           str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    replicas = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    assert set(replicas[0]) == {"allreduce", "hybrid-migrated"}
    for setting, steps in replicas[0].items():
        assert len(steps) >= 8, (setting, len(steps))
        for rank in range(1, 4):
            for step, (mine, theirs) in enumerate(zip(replicas[rank][setting], steps,
                                                      strict=True)):
                for name in theirs:
                    assert torch.equal(mine[name], theirs[name]), (setting, step, rank, name)
        first, last = steps[0], steps[-1]
        assert all(not torch.equal(first[name], last[name]) for name in first)
        # Rows start ~3x max_norm; those the batches looked up were renormalised (and then
        # moved a little by Adam): most rows are near max_norm now.
        norms = last["embedding.weight"].norm(dim=1)
        assert norms.median() < 1.1 < norms.max(), (setting, norms)


@pytest.mark.parametrize("world", [2, 4])
def test_equivalence_batches_share_rows_across_workers_with_different_counts(world: int) -> None:
    """The freq/maxnorm rows of the equivalence matrix mean something only if workers look up
    the same rows, different numbers of times: check their batches do."""
    sys.path.insert(0, str(ROOT / "tests"))
    from equivalence_cases import all_cases, global_batches, worker_slice

    for case in [c for c in all_cases() if c.model in ("freq", "maxnorm")][:6]:
        shared = 0
        for batch in global_batches(case):
            counts = [torch.bincount(worker_slice(batch, r, world)[0].reshape(-1),
                                     minlength=40) for r in range(world)]
            table = torch.stack(counts)
            seen_by = (table > 0).sum(dim=0)
            differs = table.max(dim=0).values != table.min(dim=0).values
            shared += int(((seen_by >= 2) & differs).sum())
        assert shared > 0, case.key
