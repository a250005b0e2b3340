"""TorchRec as a peer system on the LM workload (``workloads.SampledSoftmaxLM``).

Built the way a TorchRec user would: the input embedding and the sampled-softmax output weight
are the two tables of one ``EmbeddingCollection`` (sequence embeddings, not pooled), looked up
with features "tokens" and "candidates"; the LSTM is the dense part. Sharding, optimizers and
gradient division as in ``torchrec_peer`` (fused Adagrad on the tables, plain Adagrad on the
LSTM). The weights start as ``SampledSoftmaxLM(cfg)``'s after ``torch.manual_seed(seed)``.

TorchRec requires one embedding width per EmbeddingCollection, so ``cfg.emb`` must equal
``cfg.hidden``; otherwise building raises PeerUnavailable with TorchRec's error.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from torchrec_peer import build_sharded, training_step  # noqa: E402
from workloads import LMConfig, SampledSoftmaxLM, sampled_softmax_loss  # noqa: E402

LMBatch = tuple[tuple[Tensor, Tensor], Tensor]
TABLES = {"tokens": "t_tokens", "candidates": "t_candidates"}  # feature -> table


def to_lm_kjt(inputs: tuple[Tensor, Tensor]) -> Any:
    """``(tokens [B, T], candidates [N])`` as a ``KeyedJaggedTensor``: sample b holds the T
    tokens of sequence b; the candidates, shared by the whole batch, all sit in sample 0."""
    from torchrec import KeyedJaggedTensor

    tokens, candidates = inputs
    b, t = tokens.shape
    candidate_lengths = torch.zeros(b, dtype=torch.long)
    candidate_lengths[0] = candidates.numel()
    return KeyedJaggedTensor.from_lengths_sync(
        keys=list(TABLES),
        values=torch.cat([tokens.reshape(-1), candidates]),
        lengths=torch.cat([torch.full((b,), t, dtype=torch.long), candidate_lengths]))


class TorchRecLM(nn.Module):
    """EmbeddingCollection("tokens", "candidates") -> LSTM -> logits against the candidates."""

    def __init__(self, cfg: LMConfig, device: torch.device | None = None):
        super().__init__()
        from torchrec import EmbeddingCollection, EmbeddingConfig

        widths = {"tokens": cfg.emb, "candidates": cfg.hidden}
        self.ec = EmbeddingCollection(
            tables=[EmbeddingConfig(name=table, embedding_dim=widths[f],
                                    num_embeddings=cfg.vocab, feature_names=[f])
                    for f, table in TABLES.items()],
            device=device)
        self.lstm = nn.LSTM(cfg.emb, cfg.hidden, batch_first=True)
        self.emb, self.hidden_size = cfg.emb, cfg.hidden

    def forward(self, kjt: Any) -> Tensor:
        seqs = self.ec(kjt)
        embedded = seqs["tokens"].values().view(kjt.stride(), -1, self.emb)
        hidden = self.lstm(embedded)[0].reshape(-1, self.hidden_size)
        return hidden @ seqs["candidates"].values().t()  # [tokens, candidates]


def lm_weights(cfg: LMConfig, seed: int = 0) -> dict[str, Tensor]:
    """``SampledSoftmaxLM(cfg)``'s weights after ``torch.manual_seed(seed)`` (the harness's
    start), keyed like TorchRecLM's sharded state_dict."""
    torch.manual_seed(seed)
    source = SampledSoftmaxLM(cfg)
    weights = {f"ec.embeddings.{TABLES['tokens']}.weight": source.embedding.weight,
               f"ec.embeddings.{TABLES['candidates']}.weight": source.softmax_weight}
    weights.update({f"lstm.{k}": v for k, v in source.lstm.state_dict().items()})
    return {k: v.detach() for k, v in weights.items()}


def make_torchrec_lm_step(system: str, cfg: LMConfig, optimizer: str = "adagrad",
                          lr: float = 0.1, seed: int = 0) -> Callable[[LMBatch], Tensor]:
    """``step(batch) -> loss`` on the LM batch ``((tokens, candidates), targets)`` for
    ``system`` in ``torchrec_peer.SHARDINGS``, inside an initialised gloo group. Raises
    PeerUnavailable with the exact error when the configuration cannot be built."""
    dmp, opt, plan = build_sharded(system, lambda device: TorchRecLM(cfg, device=device),
                                   list(TABLES.values()), lambda: lm_weights(cfg, seed),
                                   optimizer, lr)

    return training_step(dmp, opt, plan, to_lm_kjt, sampled_softmax_loss)
