"""NMT workload: a small LSTM encoder-decoder translating English Bible verses into Spanish.

Data: the verse-aligned King James / Reina-Valera 1909 pairs of `corpora.rv1909`
(about 30,500 pairs, fetched with ``apt-get download`` into ``$PARALLAX_CACHE`` on first use).
Words are lower-cased with punctuation split off; each side keeps its most frequent words.

The model is the papers' NMT in miniature, a *mixed* model: two embeddings (sparse: a batch
reads a few hundred of their rows) and LSTMs plus a full-softmax output layer ``hidden x
tgt_vocab`` (dense, and the largest parameter). ``Seq2Seq`` takes plain tensors
``(src, tgt_in)``, so parallax and DDP run it unchanged.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import demo_data  # noqa: F401  (examples/corpora on sys.path)
import torch
import torch.nn.functional as F
from corpora.text import tokenize
from torch import Tensor, nn

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<s>", "</s>"
SPECIALS = (PAD, UNK, BOS, EOS)
PAD_ID, UNK_ID, BOS_ID, EOS_ID = range(len(SPECIALS))  # the same ids in both vocabularies

NMTBatch = tuple[tuple[Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class NMTConfig:
    """Model widths and batch shape. A vocabulary size is the embedding's (and for the target
    the output layer's) row count, specials included; a corpus with fewer word types leaves
    the last rows unused, so the model's size depends on the config only."""

    src_vocab: int = 20_000
    tgt_vocab: int = 20_000
    emb: int = 128
    hidden: int = 128
    max_len: int = 20           # tokens per source and per target sequence, after truncation
    batch: int = 32             # sentence pairs per worker
    sparse_grad: bool = False   # nn.Embedding(sparse=True), for DDP with sparse gradients


@dataclass
class Vocab:
    """Word <-> id map whose first ids are `SPECIALS`."""

    itos: list[str]
    stoi: dict[str, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if tuple(self.itos[:len(SPECIALS)]) != SPECIALS:
            raise ValueError(f"a vocabulary must start with {SPECIALS}")
        self.stoi = {word: i for i, word in enumerate(self.itos)}

    @classmethod
    def build(cls, sentences: Iterable[Sequence[str]], size: int) -> Vocab:
        """The ``size - 4`` most frequent words after the specials; ties by first occurrence,
        so the same corpus always gives the same ids."""
        if size <= len(SPECIALS):
            raise ValueError(f"vocabulary size must exceed {len(SPECIALS)}, got {size}")
        counts = Counter(word for sentence in sentences for word in sentence)
        return cls([*SPECIALS, *(w for w, _ in counts.most_common(size - len(SPECIALS)))])

    def __len__(self) -> int:
        return len(self.itos)

    def encode(self, words: Iterable[str]) -> list[int]:
        return [self.stoi.get(word, UNK_ID) for word in words]


@dataclass(frozen=True)
class ParallelData:
    """Encoded pairs: ``src [N, max_len]`` left-padded (so the encoder's last state follows
    the last real word), ``tgt [N, max_len + 1]`` = ``<s> words </s>`` right-padded; a
    sequence longer than ``max_len`` is cut, losing its ``</s>``."""

    src: Tensor
    tgt: Tensor
    src_vocab: Vocab
    tgt_vocab: Vocab

    def __len__(self) -> int:
        return self.src.shape[0]

    def target_tokens_per_pair(self) -> float:
        """Mean non-pad positions of ``tgt_out``: the words (and ``</s>``) a pair trains on."""
        return float((self.tgt[:, 1:] != PAD_ID).sum()) / len(self)


def encode_pairs(pairs: Sequence[tuple[str, str]], cfg: NMTConfig) -> ParallelData:
    """Tokenize, build both vocabularies from ``pairs`` and encode them (source, target)."""
    src_words = [tokenize(s) for s, _ in pairs]
    tgt_words = [tokenize(t) for _, t in pairs]
    src_vocab, tgt_vocab = Vocab.build(src_words, cfg.src_vocab), Vocab.build(tgt_words,
                                                                               cfg.tgt_vocab)
    return _encode(src_words, tgt_words, src_vocab, tgt_vocab, cfg.max_len)


def encode_held_out(pairs: Sequence[tuple[str, str]], vocabulary: ParallelData,
                    cfg: NMTConfig) -> ParallelData:
    """``pairs`` encoded in the vocabularies of ``vocabulary`` (the training pairs'): words the
    training pairs lack become ``<unk>``, as in any held-out set."""
    return _encode([tokenize(s) for s, _ in pairs], [tokenize(t) for _, t in pairs],
                   vocabulary.src_vocab, vocabulary.tgt_vocab, cfg.max_len)


def _encode(src_words: list[list[str]], tgt_words: list[list[str]], src_vocab: Vocab,
            tgt_vocab: Vocab, n: int) -> ParallelData:
    src = torch.full((len(src_words), n), PAD_ID, dtype=torch.long)
    tgt = torch.full((len(tgt_words), n + 1), PAD_ID, dtype=torch.long)
    for i, (s, t) in enumerate(zip(src_words, tgt_words, strict=True)):
        ids = (src_vocab.encode(s) + [EOS_ID])[:n]
        src[i, n - len(ids):] = torch.tensor(ids)
        ids = ([BOS_ID] + tgt_vocab.encode(t) + [EOS_ID])[:n + 1]
        tgt[i, :len(ids)] = torch.tensor(ids)
    return ParallelData(src, tgt, src_vocab, tgt_vocab)


def coverage(data: ParallelData) -> tuple[float, float]:
    """Fraction of source and target word tokens (specials excluded) that are not ``<unk>``."""
    def known(ids: Tensor) -> float:
        words = ids[ids >= len(SPECIALS)].numel()
        return words / (words + int((ids == UNK_ID).sum()))

    return known(data.src), known(data.tgt)


def make_batch(data: ParallelData, index: Tensor) -> NMTBatch:
    """``((src, tgt_in), tgt_out)`` of the pairs ``index``, each ``[B, max_len]``."""
    tgt = data.tgt[index]
    return (data.src[index], tgt[:, :-1]), tgt[:, 1:]


def batches(data: ParallelData, cfg: NMTConfig, rank: int = 0, world: int = 1, seed: int = 0,
            ) -> list[NMTBatch]:
    """One epoch, shuffled with ``seed``; worker ``rank`` of ``world`` gets every world-th
    pair of each global batch (as ``parallax.shard``), dropping the last partial batch."""
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))
    step = cfg.batch * world
    return [make_batch(data, order[s:s + step][rank::world])
            for s in range(0, len(data) - step + 1, step)]


class Seq2Seq(nn.Module):
    """Embedding -> LSTM encoder; its final ``(h, c)`` starts the LSTM decoder, which reads the
    target shifted right (teacher forcing); a dense Linear scores the whole target vocabulary."""

    def __init__(self, cfg: NMTConfig):
        super().__init__()
        self.src_embedding = nn.Embedding(cfg.src_vocab, cfg.emb, sparse=cfg.sparse_grad)
        self.tgt_embedding = nn.Embedding(cfg.tgt_vocab, cfg.emb, sparse=cfg.sparse_grad)
        self.encoder = nn.LSTM(cfg.emb, cfg.hidden, batch_first=True)
        self.decoder = nn.LSTM(cfg.emb, cfg.hidden, batch_first=True)
        self.output = nn.Linear(cfg.hidden, cfg.tgt_vocab)

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """``src``, ``tgt_in`` ``[B, T]`` ids -> logits ``[B, T_tgt, tgt_vocab]``."""
        _, state = self.encoder(self.src_embedding(src))
        hidden, _ = self.decoder(self.tgt_embedding(tgt_in), state)
        return self.output(hidden)


def nmt_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy over the non-pad target tokens of the batch."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=PAD_ID)
