"""TorchRec as a peer system on the NMT workload (``nmt.Seq2Seq``).

Built the way a TorchRec user would: the source and target embeddings are the two tables of
one ``EmbeddingCollection`` (sequence embeddings, not pooled), looked up with features "src"
and "tgt_in"; the encoder and decoder LSTMs and the output layer are the dense part (DDP under
DistributedModelParallel). Sharding, optimizers and gradient division as in ``torchrec_peer``
(fused Adagrad on the tables, plain Adagrad on the rest). The weights start as
``Seq2Seq(cfg)``'s after ``torch.manual_seed(seed)``; padding ids are rows like any other, as
in ``Seq2Seq`` (its embeddings have no ``padding_idx``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from nmt import NMTBatch, NMTConfig, Seq2Seq, nmt_loss  # noqa: E402
from torchrec_peer import build_sharded, training_step  # noqa: E402

TABLES = {"src": "t_src", "tgt_in": "t_tgt"}  # feature -> table


def to_nmt_kjt(inputs: tuple[Tensor, Tensor]) -> Any:
    """``(src [B, T], tgt_in [B, T])`` as a ``KeyedJaggedTensor``: sample b holds the T ids of
    its source sentence under "src" and of its shifted target under "tgt_in"."""
    from torchrec import KeyedJaggedTensor

    src, tgt_in = inputs
    lengths = torch.cat([torch.full((src.shape[0],), src.shape[1], dtype=torch.long),
                         torch.full((tgt_in.shape[0],), tgt_in.shape[1], dtype=torch.long)])
    return KeyedJaggedTensor.from_lengths_sync(
        keys=list(TABLES), values=torch.cat([src.reshape(-1), tgt_in.reshape(-1)]),
        lengths=lengths)


class TorchRecSeq2Seq(nn.Module):
    """EmbeddingCollection("src", "tgt_in") -> encoder LSTM -> decoder LSTM -> output."""

    def __init__(self, cfg: NMTConfig, device: torch.device | None = None):
        super().__init__()
        from torchrec import EmbeddingCollection, EmbeddingConfig

        rows = {"src": cfg.src_vocab, "tgt_in": cfg.tgt_vocab}
        self.ec = EmbeddingCollection(
            tables=[EmbeddingConfig(name=table, embedding_dim=cfg.emb, num_embeddings=rows[f],
                                    feature_names=[f])
                    for f, table in TABLES.items()],
            device=device)
        self.encoder = nn.LSTM(cfg.emb, cfg.hidden, batch_first=True)
        self.decoder = nn.LSTM(cfg.emb, cfg.hidden, batch_first=True)
        self.output = nn.Linear(cfg.hidden, cfg.tgt_vocab)
        self.emb = cfg.emb

    def forward(self, kjt: Any) -> Tensor:
        seqs = self.ec(kjt)
        src = seqs["src"].values().view(kjt.stride(), -1, self.emb)
        tgt_in = seqs["tgt_in"].values().view(kjt.stride(), -1, self.emb)
        _, state = self.encoder(src)
        hidden, _ = self.decoder(tgt_in, state)
        return self.output(hidden)


def nmt_weights(cfg: NMTConfig, seed: int = 0) -> dict[str, Tensor]:
    """``Seq2Seq(cfg)``'s weights after ``torch.manual_seed(seed)`` (the harness's start),
    keyed like TorchRecSeq2Seq's sharded state_dict."""
    torch.manual_seed(seed)
    source = Seq2Seq(cfg)
    tables = {"src_embedding.weight": f"ec.embeddings.{TABLES['src']}.weight",
              "tgt_embedding.weight": f"ec.embeddings.{TABLES['tgt_in']}.weight"}
    return {tables.get(k, k): v.detach() for k, v in source.state_dict().items()}


def make_torchrec_nmt_step(system: str, cfg: NMTConfig, optimizer: str = "adagrad",
                           lr: float = 0.1, seed: int = 0) -> Callable[[NMTBatch], Tensor]:
    """``step(batch) -> loss`` on the NMT batch ``((src, tgt_in), tgt_out)`` for ``system``
    in ``torchrec_peer.SHARDINGS``, inside an initialised gloo group. Raises PeerUnavailable
    with the exact error when the configuration cannot be built."""
    dmp, opt, plan = build_sharded(system, lambda device: TorchRecSeq2Seq(cfg, device=device),
                                   list(TABLES.values()), lambda: nmt_weights(cfg, seed),
                                   optimizer, lr)
    return training_step(dmp, opt, plan, to_nmt_kjt, nmt_loss)
