"""Word-level language-modelling data from any plain-text file (one sentence/verse a line).

The pipeline is deliberately simple so the demo measures training, not preprocessing:
regex tokenization, a frequency-capped vocabulary, and a token stream cut into fixed-length,
non-overlapping windows.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils.data import Dataset

UNK = "<unk>"
EOS = "<eos>"
SPECIALS = (UNK, EOS)  # their ids are 0 and 1 in every vocabulary

# A word (letters/digits, with inner apostrophes as in "lord's"), or one punctuation mark.
_TOKEN = re.compile(r"\w+(?:['\u2019]\w+)*|[^\w\s]")


def tokenize(line: str) -> list[str]:
    """Lower-cased words, with each punctuation mark as a token of its own."""
    return _TOKEN.findall(line.lower())


@dataclass
class Vocabulary:
    """Bidirectional word <-> id map; ``<unk>`` is 0, ``<eos>`` is 1."""

    itos: list[str]
    stoi: dict[str, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if tuple(self.itos[: len(SPECIALS)]) != SPECIALS:
            raise ValueError(f"vocabulary must start with {SPECIALS}")
        self.stoi = {word: i for i, word in enumerate(self.itos)}

    @classmethod
    def build(cls, token_lines: Iterable[Sequence[str]], max_size: int | None) -> Vocabulary:
        """Keep the most frequent words; ``max_size`` counts the two special tokens too.

        Ties are broken by first occurrence, so the same corpus always gives the same ids.
        """
        if max_size is not None and max_size < len(SPECIALS):
            raise ValueError(f"max_size must be at least {len(SPECIALS)}, got {max_size}")
        counts = Counter(tok for line in token_lines for tok in line if tok not in SPECIALS)
        keep = None if max_size is None else max_size - len(SPECIALS)
        return cls([*SPECIALS, *(word for word, _ in counts.most_common(keep))])

    @property
    def unk_id(self) -> int:
        return 0

    @property
    def eos_id(self) -> int:
        return 1

    def __len__(self) -> int:
        return len(self.itos)

    def encode(self, tokens: Iterable[str]) -> list[int]:
        """Ids of ``tokens``; out-of-vocabulary words map to ``<unk>``."""
        return [self.stoi.get(tok, 0) for tok in tokens]

    def decode(self, ids: Iterable[int]) -> list[str]:
        """Words of ``ids`` (handy for printing samples)."""
        return [self.itos[i] for i in ids]


def encode_lines(token_lines: Iterable[Sequence[str]], vocab: Vocabulary) -> torch.Tensor:
    """One 1-D LongTensor of the whole corpus, each line followed by ``<eos>``."""
    ids: list[int] = []
    for line in token_lines:
        ids += vocab.encode(line)
        ids.append(vocab.eos_id)
    return torch.tensor(ids, dtype=torch.long)


class LanguageModelDataset(Dataset):
    """Next-token prediction windows over a token stream.

    The stream is cut into non-overlapping chunks of ``seq_len + 1`` tokens (a ragged tail is
    dropped); item ``i`` is ``(chunk[:-1], chunk[1:])``. Windows are independent, so they can be
    shuffled and sharded freely across data-parallel workers.
    """

    def __init__(self, ids: torch.Tensor, seq_len: int) -> None:
        if ids.dim() != 1 or ids.dtype != torch.long:
            raise ValueError(f"expected a 1-D LongTensor, got {ids.dtype} of shape {ids.shape}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        self.seq_len = seq_len
        n = ids.numel() // (seq_len + 1)
        self.windows = ids[: n * (seq_len + 1)].view(n, seq_len + 1)

    def __len__(self) -> int:
        return self.windows.shape[0]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.windows[i]
        return window[:-1], window[1:]


def read_token_lines(path: str | Path) -> list[list[str]]:
    """Tokenized non-blank lines of a UTF-8 text file (undecodable bytes replaced)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        return [tokens for tokens in map(tokenize, f) if tokens]


def load_text_corpus(
    path: str | Path, max_vocab: int | None, seq_len: int, valid_fraction: float = 0.05
) -> tuple[LanguageModelDataset, LanguageModelDataset, Vocabulary]:
    """Train/validation datasets and vocabulary for a plain-text corpus.

    Validation is the last ``valid_fraction`` of the (non-blank) lines, a contiguous held-out
    tail rather than a random sample, so no verse or sentence leaks into both splits. The
    vocabulary is built from the training lines only.
    """
    if not 0.0 <= valid_fraction < 1.0:
        raise ValueError(f"valid_fraction must be in [0, 1), got {valid_fraction}")
    lines = read_token_lines(path)
    n_valid = round(len(lines) * valid_fraction)
    train_lines, valid_lines = lines[: len(lines) - n_valid], lines[len(lines) - n_valid :]
    vocab = Vocabulary.build(train_lines, max_vocab)
    train = LanguageModelDataset(encode_lines(train_lines, vocab), seq_len)
    if len(train) == 0:
        raise ValueError(f"{path}: too little text for one training window of {seq_len} tokens")
    valid = LanguageModelDataset(encode_lines(valid_lines, vocab), seq_len)
    return train, valid, vocab
