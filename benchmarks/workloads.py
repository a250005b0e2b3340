"""Benchmark workloads: plain single-device models and their data, run unchanged by every
system: the LM of the papers (LSTM, large embedding, sampled-softmax output) on a synthetic
Zipf token stream, which reaches any vocabulary size offline; a small ResNet on Fashion-MNIST;
the MovieLens recommender (`recsys.py`). `Workload` bundles one of them for the harness."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeVar

import demo_data  # noqa: F401  (examples/corpora on sys.path)
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import parallax
from parallax.cluster import current_worker

T = TypeVar("T")


@dataclass(frozen=True)
class LMConfig:
    vocab: int = 100_000
    emb: int = 128
    hidden: int = 128
    seq_len: int = 20
    batch: int = 16          # per worker
    sampled: int = 512       # negative classes per step, shared by the batch
    sparse_grad: bool = False
    corpus: str = "zipf"     # "zipf": synthetic stream of `vocab` words; "kjv": the KJV Bible


class SampledSoftmaxLM(nn.Module):
    """Embedding -> LSTM -> sampled softmax. The output table is read only through a lookup
    of the step's candidates (targets + sampled classes): sparse; with ``sparse_grad`` both
    tables give sparse gradients."""

    def __init__(self, cfg: LMConfig):
        super().__init__()
        self.embedding = nn.Embedding(cfg.vocab, cfg.emb, sparse=cfg.sparse_grad)
        self.lstm = nn.LSTM(cfg.emb, cfg.hidden, batch_first=True)
        # an nn.Embedding, so that the sparse-gradient program reads both tables with sparse
        # gradients and DDP knows it (DDP-sparse at full strength: a plain gathered Parameter
        # would keep the output weight's 51 MB gradient dense)
        self.softmax = nn.Embedding(cfg.vocab, cfg.hidden, sparse=cfg.sparse_grad)
        nn.init.normal_(self.softmax.weight, std=0.01)
        self.hidden_size = cfg.hidden

    @property
    def softmax_weight(self) -> nn.Parameter:
        return self.softmax.weight

    def forward(self, tokens: Tensor, candidates: Tensor) -> Tensor:
        hidden = self.lstm(self.embedding(tokens))[0].reshape(-1, self.hidden_size)
        return hidden @ self.softmax(candidates).t()  # [tokens, candidates]


def sampled_softmax_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Row i's true class is candidate i (candidates start with the batch's targets)."""
    return F.cross_entropy(logits, targets)


def log_uniform(vocab: int, count: int, generator: torch.Generator) -> Tensor:
    """``count`` ids drawn log-uniformly (P(k) ∝ log((k+2)/(k+1)), Zipf-like for ids sorted by
    frequency): the papers' token stream, and TensorFlow's sampled-softmax candidate sampler."""
    u = torch.rand(count, generator=generator, dtype=torch.float64)
    return ((vocab + 1) ** u - 1).long().clamp(0, vocab - 1)


def _with_candidates(cfg: LMConfig, ids: Tensor, generator: torch.Generator,
                     ) -> tuple[tuple[Tensor, Tensor], Tensor]:
    tokens, targets = ids[:, :-1], ids[:, 1:].reshape(-1)
    candidates = torch.cat([targets, log_uniform(cfg.vocab, cfg.sampled, generator)])
    return (tokens, candidates), torch.arange(targets.numel())


def zipf_lm_batch(cfg: LMConfig, generator: torch.Generator,
                  ) -> tuple[tuple[Tensor, Tensor], Tensor]:
    """One worker's batch: Zipf(≈1) token ids, as in natural text, and sampled candidates."""
    ids = log_uniform(cfg.vocab, cfg.batch * (cfg.seq_len + 1), generator)
    return _with_candidates(cfg, ids.view(cfg.batch, -1), generator)


def text_lm_batch(cfg: LMConfig, windows: Tensor, generator: torch.Generator,
                  ) -> tuple[tuple[Tensor, Tensor], Tensor]:
    """One worker's batch of random ``seq_len + 1``-token windows of a real corpus (ids sorted
    by frequency, as `corpora.text.Vocabulary` numbers them), and sampled candidates."""
    index = torch.randint(len(windows), (cfg.batch,), generator=generator)
    return _with_candidates(cfg, windows[index], generator)


def fetched_once(fetch: Callable[[], T]) -> T:
    """``fetch()``, run by rank 0 first when in a group, so that one rank downloads and the
    others read its cache."""
    if dist.is_initialized():
        if dist.get_rank() == 0:
            fetch()
        dist.barrier()
    return fetch()


def kjv_windows(cfg: LMConfig) -> tuple[Tensor, Tensor, int]:
    """The KJV Bible as ``[n, seq_len + 1]`` token windows: the training text's, the held-out
    tail's (`corpora.text.load_text_corpus`: its last 5 % of lines, never trained on, in the
    training vocabulary), and the vocabulary size (at most ``cfg.vocab``). Rank 0 downloads
    it first when run in a group."""
    from corpora.kjv import fetch_kjv
    from corpora.text import load_text_corpus

    train, valid, vocab = load_text_corpus(fetched_once(fetch_kjv), cfg.vocab, cfg.seq_len)
    return train.windows, valid.windows, len(vocab)


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


LM_OPTIMIZERS = {
    "adagrad": lambda params, lr: torch.optim.Adagrad(params, lr=lr),
    "momentum": lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9,
                                                   weight_decay=1e-5),
    "adam": lambda params, lr: torch.optim.Adam(params, lr=lr / 100),
}


class Workload:
    """A plain single-device program: model, optimizer, loss, batches, and what one batch
    counts (words or samples) per worker."""

    def __init__(self, name: str, options: dict):
        self.name = name
        # the LM's optimizer: "adagrad" (default), "momentum" (SGD, momentum 0.9, weight decay
        # 1e-5: the servers defer untouched rows' steps) or "adam" (every row each step)
        self.optimizer = options.get("optimizer", "adagrad") if name == "lm" else None
        # the model's initial weights (torch.manual_seed) and, in the harness, the data order
        self.seed = int(options.get("seed", 0))
        options = {k: v for k, v in options.items() if k != "seed"}
        if self.optimizer not in (None, *LM_OPTIMIZERS):
            raise ValueError(f"LM optimizer must be one of {sorted(LM_OPTIMIZERS)}, "
                             f"got {self.optimizer!r}")
        if name == "lm":
            self.cfg = LMConfig(**{k: v for k, v in options.items() if k != "optimizer"})
            if self.cfg.corpus == "kjv":
                self.windows, self.held_out, vocab = kjv_windows(self.cfg)
                self.cfg = replace(self.cfg, vocab=vocab)
            elif self.cfg.corpus != "zipf":
                raise ValueError(f"LM corpus must be 'zipf' or 'kjv', got {self.cfg.corpus!r}")
            self.loss = sampled_softmax_loss
            self.items, self.unit = self.cfg.batch * self.cfg.seq_len, "words"
            self.lr = 0.1
        elif name == "recsys":
            from recsys import RecConfig, batches, load_movielens, rec_loss

            self.cfg = RecConfig(**options)
            worker = current_worker()
            self.shards = itertools.cycle(batches(fetched_once(load_movielens), self.cfg,
                                                  worker.rank, worker.world_size))
            self.loss = rec_loss
            self.items, self.unit = self.cfg.batch, "samples"
            self.lr = 0.05
        elif name == "nmt":
            from corpora.rv1909 import english_spanish_pairs
            from nmt import NMTConfig, batches, encode_held_out, encode_pairs, nmt_loss

            # "held_out": the corpus's last pairs (its last books), never trained on: the
            # validation set of time_to_quality.py; the vocabularies are the rest's
            held_out = int(options.get("held_out", 0))
            self.cfg = NMTConfig(**{k: v for k, v in options.items() if k != "held_out"})
            worker = current_worker()
            pairs = fetched_once(english_spanish_pairs)
            if not 0 <= held_out < len(pairs) // 2:
                raise ValueError(f"NMT held_out must be in [0, {len(pairs) // 2}), "
                                 f"got {held_out}")
            data = encode_pairs(pairs[:len(pairs) - held_out], self.cfg)
            self.held_out = encode_held_out(pairs[len(pairs) - held_out:], data, self.cfg)
            self.shards = itertools.cycle(batches(data, self.cfg, worker.rank,
                                                  worker.world_size, seed=self.seed))
            self.loss = nmt_loss
            # Real target tokens (words and </s>, pads excluded) per worker batch, on average.
            self.items = self.cfg.batch * data.target_tokens_per_pair()
            self.unit = "words"
            self.lr = 0.1
        elif name == "cnn":
            from corpora.fashion_mnist import load_fashion_mnist

            self.images, self.labels = load_fashion_mnist("train")
            self.batch_size = options.get("batch", 64)
            self.loss = torch.nn.functional.cross_entropy
            self.items, self.unit = self.batch_size, "samples"
            self.lr = 0.05
        else:
            raise ValueError(f"unknown workload {name!r}")

    @property
    def long_bags(self) -> tuple[str, ...]:
        """The EmbeddingBag tables whose bags are long (the recommender's history): what the
        ``-pooled`` systems pool on their owners."""
        return ("history.weight",) if self.name == "recsys" and self.cfg.history else ()

    @property
    def bag_tables(self) -> tuple[str, ...]:
        """Every EmbeddingBag table (what the ``-tablewise`` systems pool on owners, as
        TorchRec's table-wise sharding does)."""
        if self.name != "recsys":
            return ()
        return ("user.weight", "item.weight", "genre.weight", *self.long_bags)

    def model_and_optimizer(self, sparse_grad: bool, *, deferred: bool = False):
        """The workload's single-device model and optimizer; ``deferred``: the model built in
        ``parallax.meta_init()`` (for parallax systems: no worker materialises a server-held
        table)."""
        if deferred:
            with parallax.meta_init():
                return self.model_and_optimizer(sparse_grad)
        torch.manual_seed(self.seed)
        if self.name == "recsys":
            from recsys import RecModel

            model = RecModel(replace(self.cfg, sparse_grad=sparse_grad))
            return model, torch.optim.Adagrad(model.parameters(), lr=self.lr)
        if self.name == "nmt":
            from nmt import Seq2Seq

            model = Seq2Seq(replace(self.cfg, sparse_grad=sparse_grad))
            return model, torch.optim.Adagrad(model.parameters(), lr=self.lr)
        if self.name == "lm":
            model = SampledSoftmaxLM(replace(self.cfg, sparse_grad=sparse_grad))
            return model, LM_OPTIMIZERS[self.optimizer](model.parameters(), self.lr)
        model = SmallResNet()
        return model, torch.optim.SGD(model.parameters(), lr=self.lr, momentum=0.9)

    def validation(self, rank: int, world: int, windows: int) -> list:
        """This rank's share of the first ``windows`` held-out samples, dealt out rank by rank
        in whole batches. The LM on the KJV: windows of its validation tail, scored by the full
        softmax (candidates are the whole vocabulary, targets the true word ids). The NMT:
        pairs of ``held_out`` (its loss is a full softmax already)."""
        if self.name == "nmt":
            from nmt import make_batch

            held_out, batch = self.held_out, self.cfg.batch
        elif self.name == "lm" and self.cfg.corpus == "kjv":
            held_out, batch = self.held_out, self.cfg.batch
        else:
            raise ValueError("a validation set exists for the LM on the KJV corpus "
                             "(--workload lm --workload-options '{\"corpus\": \"kjv\"}') and "
                             "the NMT with held-out pairs ('{\"held_out\": 1024}') only")
        if windows > len(held_out) or windows % (world * batch):
            raise ValueError(f"validation samples must be a multiple of world x batch = "
                             f"{world * batch} and at most {len(held_out)}, got {windows}")
        if self.name == "nmt":
            mine = torch.arange(windows).view(-1, world, batch)[:, rank]
            return [make_batch(held_out, index) for index in mine]
        everything = torch.arange(self.cfg.vocab)
        mine = held_out[:windows].view(-1, world, batch, self.cfg.seq_len + 1)[:, rank]
        return [((ids[:, :-1], everything), ids[:, 1:].reshape(-1)) for ids in mine]

    def batch(self, generator: torch.Generator):
        if self.name == "recsys":
            return next(self.shards)
        if self.name == "nmt":
            return next(self.shards)
        if self.name == "lm" and self.cfg.corpus == "kjv":
            return text_lm_batch(self.cfg, self.windows, generator)
        if self.name == "lm":
            return zipf_lm_batch(self.cfg, generator)
        return fashion_batch(self.images, self.labels, self.batch_size, generator)
