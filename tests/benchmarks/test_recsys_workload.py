"""The recommender benchmark workload (benchmarks/recsys.py) on synthetic ids: batching, hashing,
the model, and (when torchrec is installed) the TorchRec model's equality with it. No download."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from recsys import (  # noqa: E402
    RecConfig,
    RecModel,
    batches,
    hash_ids,
    make_batch,
    rec_loss,
    synthetic_batch,
    synthetic_movielens,
    user_histories,
)

CFG = RecConfig(num_users=50, num_items=80, emb=8, hidden=16, batch=32)


def data():
    return synthetic_movielens(1000, CFG.num_users, CFG.num_items, CFG.num_genres, seed=3)


def test_make_batch_matches_per_sample_genres():
    d = data()
    index = torch.tensor([5, 17, 3, 999])
    (users, items, genres, offsets), labels = make_batch(d, CFG, index)
    assert users.shape == items.shape == (4, 1)
    assert torch.equal(users.view(-1), d.users[index])
    assert torch.equal(labels, d.labels[index])
    ends = torch.cat([offsets[1:], torch.tensor([genres.numel()])])
    for k, i in enumerate(index.tolist()):
        item = int(d.items[i])
        expected = d.genre_ids[d.genre_ptr[item]:d.genre_ptr[item + 1]]
        assert torch.equal(genres[offsets[k]:ends[k]], expected)


def test_history_bags_hold_items_their_user_rated():
    d = data()
    index = torch.tensor([0, 17, 3, 999])
    history = user_histories(d, index, 6)
    assert history.shape == (4, 6)
    for row, i in zip(history, index.tolist(), strict=True):
        rated = set(d.items[d.users == d.users[i]].tolist())
        assert set(row.tolist()) <= rated
    cfg = replace(CFG, history=6, hash_multiplier=10)
    inputs, _ = make_batch(d, cfg, index)
    assert torch.equal(inputs[4], hash_ids(history, cfg.item_rows, 10))
    assert RecModel(cfg)(*inputs).shape == (4,)


def test_history_as_an_embedding_is_the_bag_model():
    """``history_lookup="embedding"``: an nn.Embedding summed over each sample's ids, the same
    values and gradients as the history bag (the benchmark compares the two ways of writing
    one model); anything else is refused by name."""
    bag_cfg = replace(CFG, history=6, hash_multiplier=10)
    torch.manual_seed(0)
    bag = RecModel(bag_cfg)
    summed = RecModel(replace(bag_cfg, history_lookup="embedding"))
    assert isinstance(summed.history, torch.nn.Embedding)
    summed.load_state_dict(bag.state_dict())
    inputs, labels = make_batch(data(), bag_cfg, torch.arange(40))
    for model in (bag, summed):
        rec_loss(model(*inputs), labels).backward()
    torch.testing.assert_close(summed(*inputs), bag(*inputs), rtol=1e-6, atol=1e-6)
    for (name, p), q in zip(bag.named_parameters(), summed.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)
    with pytest.raises(ValueError, match="history_lookup"):
        RecConfig(history_lookup="gather")


def test_hash_ids_identity_and_range():
    ids = torch.arange(50)
    assert torch.equal(hash_ids(ids, 50, 1), ids)
    hashed = hash_ids(ids, 50 * 1000, 1000)
    assert hashed.min() >= 0 and hashed.max() < 50_000
    assert hashed.unique().numel() == 50  # no collisions for these ids


def test_batches_shard_the_global_batch():
    d = data()
    whole = batches(d, replace(CFG, batch=64), seed=1)
    parts = [batches(d, CFG, rank, 2, seed=1) for rank in range(2)]
    assert len(whole) == len(parts[0]) == len(parts[1]) == len(d) // 64
    users = torch.cat([parts[0][0][0][0], parts[1][0][0][0]]).view(-1).sort().values
    assert torch.equal(users, whole[0][0][0].view(-1).sort().values)


@pytest.mark.parametrize("multiplier", [1, 100])
def test_model_trains(multiplier):
    cfg = replace(CFG, hash_multiplier=multiplier)
    torch.manual_seed(0)
    model = RecModel(cfg)
    assert model.user.num_embeddings == 50 * multiplier
    opt = torch.optim.Adagrad(model.parameters(), lr=0.05)
    train = batches(data(), cfg)
    first = last = None
    for _ in range(8):
        for inputs, labels in train:
            opt.zero_grad()
            loss = rec_loss(model(*inputs), labels)
            loss.backward()
            opt.step()
            first = float(loss) if first is None else first
            last = float(loss)
    assert last < first


def test_synthetic_batch_in_range():
    cfg = replace(CFG, hash_multiplier=10)
    (users, items, genres, offsets), labels = synthetic_batch(cfg, torch.Generator())
    assert users.max() < cfg.user_rows and items.max() < cfg.item_rows
    assert offsets[0] == 0 and offsets.numel() == labels.numel() == cfg.batch
    assert RecModel(cfg)(users, items, genres, offsets).shape == (cfg.batch,)


def test_parallax_single_process_plans_tables_sparse():
    parallax = pytest.importorskip("parallax")
    torch.manual_seed(0)
    model = RecModel(CFG)
    reference = RecModel(CFG)
    reference.load_state_dict(model.state_dict())
    runner = parallax.get_runner(model, torch.optim.SGD(model.parameters(), lr=0.1), rec_loss)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    try:
        for inputs, labels in batches(data(), CFG)[:3]:
            loss = runner.step((inputs, labels))
            ref_opt.zero_grad()
            ref_loss = rec_loss(reference(*inputs), labels)
            ref_loss.backward()
            ref_opt.step()
            assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
    finally:
        parallax.shutdown()


def test_torchrec_model_equals_rec_model():
    peer = pytest.importorskip("torchrec_peer")
    if not peer.torchrec_available():
        pytest.skip("torchrec / fbgemm-gpu not installed (benchmarks/setup_bench.sh)")
    for cfg in (CFG, replace(CFG, history=7),
                replace(CFG, history=7, history_lookup="embedding")):
        torch.manual_seed(0)
        model = RecModel(cfg)
        twin = peer.TorchRecModel(cfg)
        with torch.no_grad():
            for f in peer.features(cfg):
                twin.ebc.embedding_bags[f"t_{f}"].weight.copy_(getattr(model, f).weight)
            twin.mlp.load_state_dict(model.mlp.state_dict())
        inputs, _ = make_batch(data(), cfg, torch.arange(32))
        torch.testing.assert_close(twin(peer.to_kjt(inputs)), model(*inputs))


def test_torchrec_step_starts_from_rec_model(tmp_path):
    """The sharded peer (single-process gloo group) starts from RecModel's seeded weights."""
    peer = pytest.importorskip("torchrec_peer")
    if not peer.torchrec_available():
        pytest.skip("torchrec / fbgemm-gpu not installed (benchmarks/setup_bench.sh)")
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        step = peer.make_torchrec_step("torchrec-tw", CFG, lr=0.05)
        torch.manual_seed(0)
        model = RecModel(CFG)
        inputs, labels = make_batch(data(), CFG, torch.arange(32))
        expected = rec_loss(model(*inputs), labels)
        torch.testing.assert_close(step((inputs, labels)), expected.detach())
    finally:
        dist.destroy_process_group()


def test_peer_unavailable_is_structured():
    peer = pytest.importorskip("torchrec_peer")
    error = peer.PeerUnavailable("torchrec-rw", "shard", ValueError("no ROW_WISE"))
    assert error.as_dict() == {"system": "torchrec-rw", "stage": "shard",
                               "error": "ValueError: no ROW_WISE"}
    with pytest.raises(ValueError, match="unknown TorchRec system"):
        peer.make_torchrec_step("torchrec-grid", CFG)
