"""A small word-level LSTM language model for the demo.

``forward`` maps a batch of token ids straight to logits, without carrying LSTM state in or
out: each training window starts from a zero state. That keeps the model a pure function of
its input, so ``torch.fx.symbolic_trace`` can capture the whole graph, and batches can be
shuffled and sharded freely.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class LanguageModel(nn.Module):
    """Embedding -> LSTM -> (projection) -> linear decoder over the vocabulary.

    With ``tie_weights`` the decoder reuses the embedding matrix (Press & Wolf, 2017), which
    saves ``vocab_size * emb_dim`` parameters; when ``hidden != emb_dim`` a linear projection
    brings the LSTM output down to ``emb_dim`` first so the shapes match.
    """

    def __init__(
        self,
        vocab_size: int,
        emb_dim: int = 128,
        hidden: int = 256,
        layers: int = 1,
        dropout: float = 0.0,
        tie_weights: bool = False,
    ) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, emb_dim)
        # nn.LSTM's own dropout only acts between layers (and warns with a single layer).
        between = dropout if layers > 1 else 0.0
        self.lstm = nn.LSTM(emb_dim, hidden, layers, batch_first=True, dropout=between)
        self.dropout = nn.Dropout(dropout)
        project = tie_weights and hidden != emb_dim
        self.projection = nn.Linear(hidden, emb_dim) if project else nn.Identity()
        self.decoder = nn.Linear(emb_dim if tie_weights else hidden, vocab_size)
        if tie_weights:
            self.decoder.weight = self.embedding.weight

    def forward(self, tokens: Tensor) -> Tensor:
        """Logits ``[B, T, V]`` for next-token prediction from token ids ``[B, T]``."""
        x = self.dropout(self.embedding(tokens))
        x = self.lstm(x)[0]  # indexing, not unpacking, keeps the fx trace simple
        return self.decoder(self.projection(self.dropout(x)))


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy over every token in the batch (its exp is the perplexity)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


if __name__ == "__main__":
    model = LanguageModel(vocab_size=1000, tie_weights=True)
    tokens = torch.randint(0, 1000, (2, 5))
    print(torch.fx.symbolic_trace(model).graph)
    print("loss on random tokens:", lm_loss(model(tokens), tokens).item())
