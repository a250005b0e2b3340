"""The LM workload under TorchRec (benchmarks/torchrec_lm.py) against the single-device LM.

TorchRec's fused Adagrad updates only the rows a step touched; the reference is the
single-device ``SampledSoftmaxLM`` with ``sparse=True`` embeddings and ``torch.optim.Adagrad``,
whose dense-gradient output weight also leaves untouched rows alone (zero gradient, zero update).
Float32 kernels sum in different orders, so tables and LSTM are compared with
``atol=1e-5, rtol=1e-4``. Skipped when TorchRec is not installed (benchmarks/setup_bench.sh)."""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torchrec")
pytest.importorskip("fbgemm_gpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from torchrec_lm import TABLES, to_lm_kjt  # noqa: E402
from torchrec_peer import PeerUnavailable, make_torchrec_step, plan_summary  # noqa: E402
from workloads import LMConfig, SampledSoftmaxLM, sampled_softmax_loss, zipf_lm_batch  # noqa: E402

CFG = LMConfig(vocab=200, emb=8, hidden=8, seq_len=5, batch=4, sampled=16)
LR = 0.1
TOL = {"atol": 1e-5, "rtol": 1e-4}


def _init_group(store: Path, rank: int, world: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))



def _reference(optimizer: str = "adagrad") -> tuple[SampledSoftmaxLM, torch.optim.Optimizer]:
    """The single-device LM from the harness's seed, sparse embedding, Adagrad (or SGD)."""
    torch.manual_seed(0)
    model = SampledSoftmaxLM(replace(CFG, sparse_grad=True))
    opt_cls = {"adagrad": torch.optim.Adagrad, "sgd": torch.optim.SGD}[optimizer]
    return model, opt_cls(model.parameters(), lr=LR)


def _reference_step(model, opt, rank_batches) -> float:
    """One step on the mean of the ranks' losses: the mean gradient that DDP and TorchRec's
    gradient division give (each rank's sampled candidates stay its own)."""
    opt.zero_grad()
    loss = sum(sampled_softmax_loss(model(*inputs), targets)
               for inputs, targets in rank_batches) / len(rank_batches)
    loss.backward()
    opt.step()
    return float(loss.detach())


def _reference_tables(model: SampledSoftmaxLM) -> dict[str, torch.Tensor]:
    return {TABLES["tokens"]: model.embedding.weight.detach(),
            TABLES["candidates"]: model.softmax_weight.detach()}


def _assert_local_shards_match(dmp, reference: SampledSoftmaxLM) -> None:
    """This rank's rows of each table, and the replicated LSTM, equal the reference's."""
    state = dmp.state_dict()
    for table, expected in _reference_tables(reference).items():
        shards = state[f"ec.embeddings.{table}.weight"].local_shards()
        for shard in shards:
            (row, col), (rows, cols) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            torch.testing.assert_close(shard.tensor, expected[row:row + rows, col:col + cols],
                                       **TOL, msg=lambda m, t=table: f"{t}: {m}")
    for name, expected in reference.lstm.state_dict().items():
        torch.testing.assert_close(state[f"lstm.{name}"], expected, **TOL)


@pytest.mark.parametrize("system", ["torchrec-rw", "torchrec-tw"])
def test_torchrec_lm_loss_equals_sampled_softmax_lm(gloo_group, system):
    step = make_torchrec_step(system, CFG, lr=LR)
    reference, _ = _reference()
    (tokens, candidates), targets = zipf_lm_batch(CFG, torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = step.model(to_lm_kjt((tokens, candidates)))
        expected = reference(tokens, candidates)
    torch.testing.assert_close(logits, expected)
    torch.testing.assert_close(sampled_softmax_loss(logits, targets),
                               sampled_softmax_loss(expected, targets))


@pytest.mark.parametrize("system", ["torchrec-rw", "torchrec-tw"])
def test_torchrec_lm_trains_like_sparse_adagrad_lm(gloo_group, system):
    step = make_torchrec_step(system, CFG, lr=LR)
    reference, opt = _reference()
    initial = {t: w.clone() for t, w in _reference_tables(reference).items()}
    generator = torch.Generator().manual_seed(1)
    touched = {t: torch.zeros(CFG.vocab, dtype=torch.bool) for t in initial}
    for _ in range(2):
        batch = zipf_lm_batch(CFG, generator)
        (tokens, candidates), _ = batch
        touched[TABLES["tokens"]][tokens.reshape(-1)] = True
        touched[TABLES["candidates"]][candidates] = True
        loss = step(batch)
        expected_loss = _reference_step(reference, opt, [batch])
        assert float(loss) == pytest.approx(expected_loss, rel=1e-5)
        _assert_local_shards_match(step.model, reference)
    for table, rows in touched.items():
        assert rows.any() and not rows.all()  # the check below means something
        final = _reference_tables(reference)[table]
        assert torch.equal(final[~rows], initial[table][~rows])
        assert not torch.allclose(final[rows], initial[table][rows])


def test_torchrec_lm_unequal_widths_is_unavailable(gloo_group):
    """One EmbeddingCollection holds one width: TorchRec's own error, not a fake run."""
    with pytest.raises(PeerUnavailable, match="same embedding dimension"):
        make_torchrec_step("torchrec-tw", replace(CFG, hidden=16), lr=LR)


def _two_rank_worker(rank: int, store: str, world: int) -> None:
    """Each system on 2 ranks, 2 steps, against the reference on both ranks' batches. Adagrad
    is blind to a gradient's scale, so SGD also checks the division by the world size."""
    _init_group(Path(store), rank, world)
    try:
        for system, optimizer in (("torchrec-rw", "adagrad"), ("torchrec-tw", "adagrad"),
                                  ("torchrec-rw", "sgd")):
            step = make_torchrec_step(system, CFG, optimizer=optimizer, lr=LR)
            for desc in plan_summary(step.plan).values():
                if system == "torchrec-rw":  # each table split by rows over both ranks
                    assert desc.startswith("row_wise fused ranks=[0, 1]"), desc
                else:  # each table whole on one rank
                    assert desc.startswith("table_wise fused") and "rows=[200]" in desc, desc
            reference, opt = _reference(optimizer)
            generators = [torch.Generator().manual_seed(1000 + r) for r in range(world)]
            for _ in range(2):
                batches = [zipf_lm_batch(CFG, g) for g in generators]
                step(batches[rank])
                _reference_step(reference, opt, batches)
                _assert_local_shards_match(step.model, reference)
            # the trained model's forward through TorchRec (both ranks' lookups) as on one device
            inputs, targets = batches[rank]
            with torch.no_grad():
                torch.testing.assert_close(
                    sampled_softmax_loss(step.model(to_lm_kjt(inputs)), targets),
                    sampled_softmax_loss(reference(*inputs), targets), **TOL)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def test_torchrec_lm_two_ranks_row_and_table_wise(tmp_path):
    """Two processes (gloo, file store): row-wise and table-wise build, step, and keep each
    rank's shards equal to the single-device LM trained on both ranks' batches (mean loss)."""
    import torch.multiprocessing as mp

    context = mp.spawn(_two_rank_worker, args=(str(tmp_path / "store"), 2), nprocs=2,
                       join=False)
    deadline = time.monotonic() + 180
    try:
        while not context.join(timeout=5):  # raises as soon as a rank fails
            if time.monotonic() > deadline:
                pytest.fail("2-rank TorchRec LM run still going after 180 s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
