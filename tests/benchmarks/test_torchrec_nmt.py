"""The NMT workload under TorchRec (benchmarks/torchrec_nmt.py) against the single-device
``Seq2Seq`` with sparse embeddings and ``torch.optim.Adagrad`` (TorchRec's fused Adagrad
updates the rows a step touched, as sparse Adagrad does). Float32 kernels sum in different
orders: ``atol=1e-5, rtol=1e-4``. Skipped when TorchRec is not installed."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchrec")
pytest.importorskip("fbgemm_gpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from nmt import NMTConfig, Seq2Seq, nmt_loss  # noqa: E402
from torchrec_nmt import TABLES  # noqa: E402
from torchrec_peer import make_torchrec_step  # noqa: E402

CFG = NMTConfig(src_vocab=40, tgt_vocab=50, emb=8, hidden=8, max_len=5, batch=4)
LR = 0.1
TOL = {"atol": 1e-5, "rtol": 1e-4}



def batch(generator: torch.Generator):
    src = torch.randint(0, CFG.src_vocab, (CFG.batch, CFG.max_len), generator=generator)
    tgt = torch.randint(0, CFG.tgt_vocab, (CFG.batch, CFG.max_len + 1), generator=generator)
    return (src, tgt[:, :-1]), tgt[:, 1:]


@pytest.mark.parametrize("system", ["torchrec-rw", "torchrec-tw"])
def test_torchrec_nmt_trains_like_sparse_adagrad_seq2seq(gloo_group, system):
    step = make_torchrec_step(system, CFG, lr=LR)
    torch.manual_seed(0)
    reference = Seq2Seq(replace(CFG, sparse_grad=True))
    opt = torch.optim.Adagrad(reference.parameters(), lr=LR)
    generator = torch.Generator().manual_seed(1)
    for _ in range(2):
        inputs, targets = batch(generator)
        loss = step((inputs, targets))
        opt.zero_grad()
        expected = nmt_loss(reference(*inputs), targets)
        expected.backward()
        opt.step()
        assert float(loss) == pytest.approx(float(expected), rel=1e-5)
    state = step.model.state_dict()
    tables = {TABLES["src"]: reference.src_embedding.weight,
              TABLES["tgt_in"]: reference.tgt_embedding.weight}
    for table, expected in tables.items():
        for shard in state[f"ec.embeddings.{table}.weight"].local_shards():
            (row, col), (rows, cols) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            torch.testing.assert_close(shard.tensor, expected.detach()[row:row + rows,
                                                                       col:col + cols], **TOL)
    for name, expected in reference.state_dict().items():
        if "embedding" not in name:
            torch.testing.assert_close(state[name], expected, **TOL)
    # what time_to_quality.py evaluates: the model on step.to_input's batch
    inputs, targets = batch(generator)
    with torch.no_grad():
        torch.testing.assert_close(nmt_loss(step.model(step.to_input(inputs)), targets),
                                   nmt_loss(reference(*inputs), targets), **TOL)
