"""The NMT benchmark workload (benchmarks/nmt.py): vocabulary, padding, sharding, the pad-free
loss, the Seq2Seq model, parallax's plan for it, and (network) training on the real
English-Spanish Bible pairs through `Workload("nmt", ...)`."""

from __future__ import annotations

import shutil
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from nmt import (  # noqa: E402
    BOS_ID,
    EOS_ID,
    PAD_ID,
    SPECIALS,
    UNK_ID,
    NMTConfig,
    Seq2Seq,
    Vocab,
    batches,
    encode_held_out,
    encode_pairs,
    nmt_loss,
)

CFG = NMTConfig(src_vocab=60, tgt_vocab=70, emb=8, hidden=16, max_len=6, batch=4)


def synthetic_pairs(n: int = 64, seed: int = 0) -> list[tuple[str, str]]:
    """Sentences of 1-9 words over small vocabularies; the target echoes the source."""
    g = torch.Generator().manual_seed(seed)
    pairs = []
    for _ in range(n):
        words = torch.randint(0, 50, (int(torch.randint(1, 10, (1,), generator=g)),),
                              generator=g).tolist()
        pairs.append((" ".join(f"w{w}" for w in words), " ".join(f"p{w}" for w in words)))
    return pairs


def test_vocab_keeps_most_frequent_after_specials() -> None:
    vocab = Vocab.build([["b", "a", "b"], ["c", "b", "a"], ["d"]], size=6)
    assert vocab.itos == [*SPECIALS, "b", "a"]
    assert SPECIALS == ("<pad>", "<unk>", "<s>", "</s>")
    assert vocab.encode(["a", "zzz"]) == [5, UNK_ID]
    with pytest.raises(ValueError):
        Vocab.build([["a"]], size=4)


def test_encode_pairs_left_pads_source_and_cuts_long_sequences() -> None:
    cfg = replace(CFG, max_len=5)
    data = encode_pairs([("Jesus wept.", "Y lloró Jesús."), ("a b c d e f", "u v w x y z")],
                        cfg)
    src, tgt = data.src_vocab.encode, data.tgt_vocab.encode
    assert data.src.tolist() == [[PAD_ID, *src(["jesus", "wept", "."]), EOS_ID],
                                 src(["a", "b", "c", "d", "e"])]  # cut: no </s>
    assert data.tgt.tolist() == [[BOS_ID, *tgt(["y", "lloró", "jesús", "."]), EOS_ID],
                                 [BOS_ID, *tgt(["u", "v", "w", "x", "y"])]]
    assert data.target_tokens_per_pair() == 5.0


def test_held_out_pairs_use_the_training_vocabularies() -> None:
    train = encode_pairs([("a b", "x y"), ("a c", "x z")], CFG)
    held = encode_held_out([("a new", "x unseen")], train, CFG)
    assert held.src_vocab is train.src_vocab and held.tgt_vocab is train.tgt_vocab
    assert held.src[0, -3:].tolist() == [train.src_vocab.stoi["a"], UNK_ID, EOS_ID]
    assert held.tgt[0, :4].tolist() == [BOS_ID, train.tgt_vocab.stoi["x"], UNK_ID, EOS_ID]


def test_batches_shard_the_global_batch() -> None:
    data = encode_pairs(synthetic_pairs(), CFG)
    whole = batches(data, replace(CFG, batch=8), seed=1)
    parts = [batches(data, CFG, rank, 2, seed=1) for rank in range(2)]
    assert len(whole) == len(parts[0]) == len(parts[1]) == 64 // 8
    (src, tgt_in), tgt_out = whole[0]
    assert src.shape == tgt_in.shape == tgt_out.shape == (8, CFG.max_len)
    assert torch.equal(tgt_in[:, 1:], tgt_out[:, :-1]) and (tgt_in[:, 0] == BOS_ID).all()
    # Worker r gets pairs r, r+2, ... of each global batch, as parallax.shard does.
    assert torch.equal(parts[1][0][0][0], src[1::2]) and torch.equal(parts[0][0][1], tgt_out[::2])


def test_loss_ignores_pads() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 4, 10)
    targets = torch.tensor([[5, 6, EOS_ID, PAD_ID], [7, 8, 9, 5], [6, PAD_ID, PAD_ID, PAD_ID]])
    real = targets != PAD_ID
    torch.testing.assert_close(nmt_loss(logits, targets),
                               F.cross_entropy(logits[real], targets[real]))
    noisy = logits.clone()
    noisy[~real] = 100.0 * torch.randn_like(noisy[~real])  # whatever the model says at pads
    torch.testing.assert_close(nmt_loss(noisy, targets), nmt_loss(logits, targets))


@pytest.mark.parametrize("sparse_grad", [False, True])
def test_seq2seq_shapes_and_gradient_kinds(sparse_grad: bool) -> None:
    torch.manual_seed(0)
    model = Seq2Seq(replace(CFG, sparse_grad=sparse_grad))
    (src, tgt_in), tgt_out = batches(encode_pairs(synthetic_pairs(), CFG), CFG)[0]
    logits = model(src, tgt_in)
    assert logits.shape == (CFG.batch, CFG.max_len, CFG.tgt_vocab)
    nmt_loss(logits, tgt_out).backward()
    assert model.src_embedding.weight.grad.is_sparse is sparse_grad
    assert model.tgt_embedding.weight.grad.is_sparse is sparse_grad
    assert not model.output.weight.grad.is_sparse
    assert model.output.weight.shape == (CFG.tgt_vocab, CFG.hidden)


def test_parallax_single_process_plans_embeddings_sparse_and_output_dense() -> None:
    parallax = pytest.importorskip("parallax")
    torch.manual_seed(0)
    model, reference = Seq2Seq(CFG), Seq2Seq(CFG)
    reference.load_state_dict(model.state_dict())
    runner = parallax.get_runner(model, torch.optim.Adagrad(model.parameters(), lr=0.1),
                                 nmt_loss)
    ref_opt = torch.optim.Adagrad(reference.parameters(), lr=0.1)
    try:
        kinds = {p.name: p.sparse for p in runner.plan.parameters}
        assert kinds["src_embedding.weight"] and kinds["tgt_embedding.weight"]
        assert not kinds["output.weight"] and not kinds["output.bias"]
        assert not any(kinds[name] for name in kinds if name.startswith(("encoder", "decoder")))
        for inputs, targets in batches(encode_pairs(synthetic_pairs(), CFG), CFG)[:3]:
            loss = runner.step((inputs, targets))
            ref_opt.zero_grad()
            ref_loss = nmt_loss(reference(*inputs), targets)
            ref_loss.backward()
            ref_opt.step()
            assert float(loss) == pytest.approx(float(ref_loss.detach()), rel=1e-5)
    finally:
        parallax.shutdown()


@pytest.mark.network
@pytest.mark.skipif(shutil.which("apt-get") is None, reason="needs apt-get (Debian/Ubuntu)")
def test_workload_trains_on_real_pairs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`Workload("nmt", options)` in a one-process group, as the benchmark harness builds it;
    a small model so that 30 steps are quick. The pairs come from the default cache."""
    from workloads import Workload

    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        options = {"src_vocab": 2000, "tgt_vocab": 2000, "emb": 32, "hidden": 64, "batch": 32}
        workload = Workload("nmt", {**options, "held_out": 128})
    finally:
        dist.destroy_process_group()
    assert workload.cfg == NMTConfig(**options) and workload.unit == "words"
    # the validation set: held-out pairs (the corpus's last), dealt to ranks in whole batches
    assert len(workload.held_out) == 128
    mine = workload.validation(1, 2, 128)
    assert len(mine) == 2 and torch.equal(mine[0][0][0], workload.held_out.src[32:64])
    with pytest.raises(ValueError, match="multiple of world x batch"):
        workload.validation(0, 2, 96)
    # Real target tokens per batch: most verses are cut at max_len, so close to the maximum.
    assert 0.8 * 32 * 20 < workload.items < 32 * 20
    model, opt = workload.model_and_optimizer(sparse_grad=False)
    assert isinstance(model, Seq2Seq) and isinstance(opt, torch.optim.Adagrad)
    losses = []
    for _ in range(30):
        (src, tgt_in), tgt_out = workload.batch(torch.Generator())
        assert src.shape == tgt_out.shape == (32, 20)
        opt.zero_grad()
        loss = workload.loss(model(src, tgt_in), tgt_out)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    print(f"nmt loss over 30 steps: {losses[0]:.2f} -> {sum(losses[-5:]) / 5:.2f}")
    assert losses[0] == pytest.approx(7.6, abs=0.3)  # ln(2000): uniform over the vocabulary
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5
    # Every system starts from the same seeded weights, whatever the gradient kind.
    sparse_model, _ = workload.model_and_optimizer(sparse_grad=True)
    dense_model, _ = workload.model_and_optimizer(sparse_grad=False)
    assert sparse_model.src_embedding.sparse and not dense_model.src_embedding.sparse
    for a, b in zip(sparse_model.parameters(), dense_model.parameters(), strict=True):
        assert torch.equal(a, b)
