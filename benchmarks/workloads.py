"""Benchmark workloads: plain single-device models and their data, run unchanged by every
system. So far: the LM of the papers (LSTM, large embedding, sampled-softmax output) on a
synthetic Zipf token stream, which reaches any vocabulary size offline."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class LMConfig:
    vocab: int = 100_000
    emb: int = 128
    hidden: int = 128
    seq_len: int = 20
    batch: int = 16          # per worker
    sampled: int = 512       # negative classes per step, shared by the batch
    sparse_grad: bool = False


class SampledSoftmaxLM(nn.Module):
    """Embedding -> LSTM -> sampled softmax. The output weight is read only through a row
    gather of the step's candidates (targets + sampled classes): sparse, found by tracing."""

    def __init__(self, cfg: LMConfig):
        super().__init__()
        self.embedding = nn.Embedding(cfg.vocab, cfg.emb, sparse=cfg.sparse_grad)
        self.lstm = nn.LSTM(cfg.emb, cfg.hidden, batch_first=True)
        self.softmax_weight = nn.Parameter(torch.randn(cfg.vocab, cfg.hidden) * 0.01)
        self.hidden_size = cfg.hidden

    def forward(self, tokens: Tensor, candidates: Tensor) -> Tensor:
        hidden = self.lstm(self.embedding(tokens))[0].reshape(-1, self.hidden_size)
        return hidden @ self.softmax_weight[candidates].t()  # [tokens, candidates]


def sampled_softmax_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Row i's true class is candidate i (candidates start with the batch's targets)."""
    return F.cross_entropy(logits, targets)


def zipf_lm_batch(cfg: LMConfig, generator: torch.Generator,
                  ) -> tuple[tuple[Tensor, Tensor], Tensor]:
    """One worker's batch: Zipf(≈1) token ids, as in natural text, and sampled candidates."""
    count = cfg.batch * (cfg.seq_len + 1)
    u = torch.rand(count, generator=generator, dtype=torch.float64)
    ids = ((cfg.vocab + 1) ** u - 1).long().clamp(0, cfg.vocab - 1).view(cfg.batch, -1)
    tokens, targets = ids[:, :-1], ids[:, 1:].reshape(-1)
    u = torch.rand(cfg.sampled, generator=generator, dtype=torch.float64)
    sampled = ((cfg.vocab + 1) ** u - 1).long().clamp(0, cfg.vocab - 1)
    candidates = torch.cat([targets, sampled])
    return (tokens, candidates), torch.arange(targets.numel())


class SmallResNet(nn.Module):
    """A small ResNet-style CNN for 28x28 grey images: every parameter dense."""

    def __init__(self, width: int = 32, classes: int = 10):
        super().__init__()
        self.stem = nn.Conv2d(1, width, 3, padding=1)
        self.block = nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.ReLU(),
                                   nn.Conv2d(width, width, 3, padding=1))
        self.down = nn.Conv2d(width, 2 * width, 3, stride=2, padding=1)
        self.head = nn.Linear(2 * width, classes)

    def forward(self, images: Tensor) -> Tensor:
        x = F.relu(self.stem(images))
        x = F.relu(x + self.block(x))
        x = F.relu(self.down(x))
        return self.head(x.mean(dim=(2, 3)))


def fashion_batch(images: Tensor, labels: Tensor, batch: int, generator: torch.Generator,
                  ) -> tuple[Tensor, Tensor]:
    index = torch.randint(0, len(labels), (batch,), generator=generator)
    return images[index], labels[index]
