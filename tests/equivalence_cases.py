"""The equivalence matrix: models x optimizers x clipping x dtypes x semantics.

Shared by the distributed worker script (tests/scripts/equivalence_worker.py), which trains every
case under parallax, and by tests/test_equivalence.py, which trains the same case as the plain
single-device program with the global batch and compares the parameters.
"""

from __future__ import annotations

import contextlib
import itertools
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import parallax

GLOBAL_BATCH = 8
STEPS = 6
VOCAB = 40
SEQ = 5


# ---- models ----------------------------------------------------------------------------------
class DenseOnly(nn.Module):
    def __init__(self, sparse_grad: bool = False):
        super().__init__()
        self.hidden = nn.Linear(6, 12)
        self.out = nn.Linear(12, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.tanh(self.hidden(x)))


class SparseOnly(nn.Module):
    """Only an embedding table: every parameter lives on the servers."""

    def __init__(self, sparse_grad: bool = False):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, 4, sparse=sparse_grad, padding_idx=0)

    def forward(self, ids: Tensor) -> Tensor:
        return self.embedding(ids).mean(dim=1)


class Mixed(nn.Module):
    """Embedding + EmbeddingBag (sparse) feeding an MLP (dense), as a recommender/NLP model."""

    def __init__(self, sparse_grad: bool = False):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, 6, sparse=sparse_grad)
        self.bag = nn.EmbeddingBag(VOCAB // 2, 3, mode="mean", sparse=sparse_grad)
        self.hidden = nn.Linear(9, 10)
        self.out = nn.Linear(10, 4)

    def forward(self, ids: Tensor) -> Tensor:
        pooled = self.embedding(ids).mean(dim=1)
        bagged = self.bag(ids % (VOCAB // 2))
        return self.out(torch.relu(self.hidden(torch.cat([pooled, bagged], dim=1))))


class TiedLM(nn.Module):
    """Tiny language model with input and output embeddings tied: the table is dense."""

    def __init__(self, sparse_grad: bool = False):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, 8)
        self.mix = nn.Linear(8, 8)
        self.decoder = nn.Linear(8, VOCAB)
        self.decoder.weight = self.embedding.weight

    def forward(self, ids: Tensor) -> Tensor:
        return self.decoder(torch.tanh(self.mix(self.embedding(ids))))


class CustomGather(nn.Module):
    """Plain parameters read only by row gathers: found sparse by the fx trace."""

    def __init__(self, sparse_grad: bool = False):
        super().__init__()
        self.table = nn.Parameter(torch.randn(VOCAB, 5) * 0.5)
        self.bias_rows = nn.Parameter(torch.randn(VOCAB, 4) * 0.1)
        self.wide = nn.Parameter(torch.randn(VOCAB, 4) * 0.1)
        self.out = nn.Linear(5, 4)

    def forward(self, ids: Tensor) -> Tensor:
        rows = F.embedding(ids, self.table, padding_idx=0)
        bias = self.bias_rows[ids].sum(dim=1)
        wide = self.wide.index_select(0, ids[:, 0])
        return self.out(rows.mean(dim=1)) + bias + wide


class Untraceable(nn.Module):
    """Data-dependent control flow defeats torch.fx: only the module rule finds the table."""

    def __init__(self, sparse_grad: bool = False):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, 6)
        self.out = nn.Linear(6, 4)

    def forward(self, ids: Tensor) -> Tensor:
        pooled = self.embedding(ids).mean(dim=1)
        # A Python branch on data (true for every valid batch, so any split of the global batch
        # takes it too: a branch on batch statistics could not be data-parallel at all).
        if bool((ids >= 0).all()):
            pooled = pooled * 0.5
        return self.out(pooled)


class FrequencyScaled(nn.Module):
    """scale_grad_by_freq on an Embedding (with padding) and on a functional gather: each
    row's gradient over its count in the global batch. (nn.EmbeddingBag with it is refused:
    torch 2.13's CPU kernel divides by the wrong count, pytorch/pytorch#190063.)"""

    def __init__(self, sparse_grad: bool = False):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, 4, scale_grad_by_freq=True, padding_idx=0)
        self.table = nn.Parameter(torch.randn(VOCAB, 3))
        self.out = nn.Linear(7, 4)

    def forward(self, ids: Tensor) -> Tensor:
        gathered = F.embedding(ids, self.table, scale_grad_by_freq=True).mean(dim=1)
        return self.out(torch.cat([self.embedding(ids).mean(dim=1), gathered], dim=1))


class MaxNormed(nn.Module):
    """max_norm on an Embedding, a mean EmbeddingBag (L1 norm) and a functional gather: every
    row the global batch looks up is renormalised in place before the lookup."""

    def __init__(self, sparse_grad: bool = False):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, 4, max_norm=1.0, sparse=sparse_grad)
        self.bag = nn.EmbeddingBag(VOCAB // 2, 3, mode="mean", max_norm=0.8, norm_type=1.0,
                                   sparse=sparse_grad)
        self.table = nn.Parameter(torch.randn(VOCAB, 2) * 2)
        self.out = nn.Linear(9, 4)

    def forward(self, ids: Tensor) -> Tensor:
        gathered = F.embedding(ids, self.table, max_norm=1.5).mean(dim=1)
        return self.out(torch.cat([self.embedding(ids).mean(dim=1),
                                   self.bag(ids % (VOCAB // 2)), gathered], dim=1))


class BagOptions(nn.Module):
    """The other lookup options: sum bags over flat ids with offsets, include_last_offset,
    per-sample weights and a padding_idx; max bags; a frozen pretrained table
    (from_pretrained); F.embedding_bag on a plain parameter (read densely by the bag kernel:
    the parameter stays dense)."""

    def __init__(self, sparse_grad: bool = False):
        super().__init__()
        self.sum_bag = nn.EmbeddingBag(VOCAB, 3, mode="sum", padding_idx=0,
                                       include_last_offset=True)
        self.max_bag = nn.EmbeddingBag(VOCAB // 2, 3, mode="max")
        self.frozen = nn.Embedding.from_pretrained(torch.randn(VOCAB, 2), freeze=True)
        self.functional = nn.Parameter(torch.randn(VOCAB, 2))
        self.out = nn.Linear(10, 4)

    def forward(self, ids: Tensor) -> Tensor:
        flat = ids.reshape(-1)
        offsets = torch.arange(0, flat.numel() + 1, ids.shape[1],
                               device=ids.device)  # one more: the last end
        weights = 0.5 + (flat % 3).to(self.out.weight.dtype) * 0.5
        summed = self.sum_bag(flat, offsets, per_sample_weights=weights)
        maxed = self.max_bag(ids % (VOCAB // 2))
        bagged = F.embedding_bag(ids, self.functional, mode="sum")
        return self.out(torch.cat([summed, maxed, self.frozen(ids).mean(dim=1), bagged], dim=1))


class LstmLM(nn.Module):
    """An LSTM language model whose forward takes and returns the hidden state, as in
    truncated back-propagation through time: ``logits, hidden = model(ids, hidden)``."""

    def __init__(self, sparse_grad: bool = False):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, 6, sparse=sparse_grad)
        self.lstm = nn.LSTM(6, 8, batch_first=True)
        self.decoder = nn.Linear(8, VOCAB)

    def forward(self, ids: Tensor, hidden: tuple[Tensor, Tensor] | None = None,
                ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        output, hidden = self.lstm(self.embedding(ids), hidden)
        return self.decoder(output), hidden


MODELS: dict[str, type[nn.Module]] = {
    "dense": DenseOnly, "sparse": SparseOnly, "mixed": Mixed, "tied": TiedLM,
    "gather": CustomGather, "untraceable": Untraceable,
}
# Lookup options (README's audit table): their own rows of the matrix, not every combination.
OPTION_MODELS: dict[str, type[nn.Module]] = {"freq": FrequencyScaled, "maxnorm": MaxNormed,
                                             "bags": BagOptions}
# Models of the user's-own-loop cases (parallax.distribute) only.
LOOP_MODELS: dict[str, type[nn.Module]] = {"lstm": LstmLM}
# How a `loop` case's program trains (tests/scripts/equivalence_worker.py, _loop_reference):
# plain: zero_grad, forward, loss, backward, clip_grad_norm_ (if clip), step; accumulate: two
# micro-batches (loss / 2 each) per step; extra: plus a loss term on a dense weight; closure:
# optimizer.step(closure); bptt: the hidden state carried from one batch to the next; scaler:
# a loss scaler (torch.amp.GradScaler / parallax.GradScaler) whose scale overflows every few
# steps: those steps are skipped, the scale backs off, then grows again. Its factors are
# 2**8 so that every overflow is one by far: whether a sum overflows depends on its order
# (per worker, then across workers, or all at once on one device), so a scale near the edge
# could be skipped on one side only, under DDP as here.
LOOPS = ("plain", "accumulate", "extra", "closure", "bptt", "scaler")
SCALER = {"init_scale": 2.0 ** 120, "growth_factor": 2.0 ** 8, "backoff_factor": 2.0 ** -8,
          "growth_interval": 2}
EXTRA_TERM = 0.01


# ---- optimizers ------------------------------------------------------------------------------
def _single(cls: type[torch.optim.Optimizer], **kwargs) -> Callable:
    return lambda model: [cls(model.parameters(), **kwargs)]


def _sparse_adam_plus_adam(model: nn.Module) -> list[torch.optim.Optimizer]:
    sparse = [p for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))
              for p in m.parameters()]
    dense = [p for p in model.parameters() if all(p is not s for s in sparse)]
    opts: list[torch.optim.Optimizer] = [torch.optim.SparseAdam(sparse, lr=0.05)]
    if dense:
        opts.append(torch.optim.Adam(dense, lr=0.02))
    return opts


OPTIMIZERS: dict[str, Callable[[nn.Module], list[torch.optim.Optimizer]]] = {
    "sgd": _single(torch.optim.SGD, lr=0.5),
    "momentum": _single(torch.optim.SGD, lr=0.2, momentum=0.9, weight_decay=0.01),
    "adagrad": _single(torch.optim.Adagrad, lr=0.3),
    "adam": _single(torch.optim.Adam, lr=0.05),
    "adamw": _single(torch.optim.AdamW, lr=0.05, weight_decay=0.1),
    "sparseadam": _sparse_adam_plus_adam,
}
MATRIX_OPTIMIZERS = tuple(OPTIMIZERS)  # the products below; the ones after: targeted cases
# Constructor arguments that act in the constructor itself (Adagrad's initial state).
OPTIMIZERS["adagrad-init"] = _single(torch.optim.Adagrad, lr=0.3, lr_decay=0.01,
                                     initial_accumulator_value=0.1)
# Optimizers that accept the sparse (COO) gradients of nn.Embedding(sparse=True).
SPARSE_GRAD_OPTIMIZERS = {"sgd", "adagrad", "sparseadam"}


@dataclass(frozen=True)
class Case:
    model: str
    optimizer: str
    sparse_grad: bool = False
    clip: float | None = None
    dtype: str = "float64"
    average_sparse: bool = True
    average_dense: bool = True
    num_partitions: int | None = None
    scheduler: bool = False
    architecture: str = "hybrid"
    dense_sync: str = "hierarchical"
    loop: str | None = None  # one of LOOPS: trained through parallax.distribute's surface
    local_aggregation: bool | None = None
    migrate_after: int = 0  # > 0: alpha_threshold 0 moves every sparse table to AllReduce
    lazy: bool = False  # Config(lazy_sparse_updates): equals the program with sparse=True
    repartition: tuple[int, int] | None = None  # (after step, into P): Runner.repartition
    # "context": model built inside parallax.partitioner(); "call": parallax.partition(model).
    # The partition count is then searched in process during training (2 steps per sample).
    search: str | None = None
    meta: bool = False  # built in parallax.meta_init (every tensor deferred): servers replay
    # seed 001's operation placements moved back (Config.after_aggregation / id_dedup)
    after_aggregation: str = "servers"
    id_dedup: str = "workers"
    steps: int = STEPS
    seed: int = field(default=0)

    @property
    def key(self) -> str:
        parts = [self.architecture, self.model, self.optimizer,
                 "sparsegrad" if self.sparse_grad else "densegrad",
                 f"clip{self.clip}" if self.clip else "noclip", self.dtype]
        if not self.average_sparse:
            parts.append("sumsparse")
        if not self.average_dense:
            parts.append("sumdense")
        if self.num_partitions:
            parts.append(f"P{self.num_partitions}")
        if self.scheduler:
            parts.append("sched")
        if self.local_aggregation is not None:
            parts.append("localagg" if self.local_aggregation else "nolocalagg")
        if self.migrate_after:
            parts.append(f"migrate{self.migrate_after}")
        if self.lazy:
            parts.append("lazy")
        if self.repartition:
            parts.append("repartition{}to{}".format(*self.repartition))
        if self.search:
            parts.append(f"search{self.search}")
        if self.dense_sync != "hierarchical":
            parts.append(self.dense_sync)
        if self.loop:
            parts.append(f"loop{self.loop}")
        if self.meta:
            parts.append("meta")
        if self.after_aggregation != "servers":
            parts.append(f"after{self.after_aggregation}")
        if self.id_dedup != "workers":
            parts.append(f"dedup{self.id_dedup}")
        return "-".join(parts)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


def all_cases() -> list[Case]:
    cases = []
    for model, opt, clip, dtype in itertools.product(
            MODELS, MATRIX_OPTIMIZERS, (None, 0.05), ("float32", "float64")):
        for sparse_grad in (False, True):
            if sparse_grad and (opt not in SPARSE_GRAD_OPTIMIZERS
                                or model not in ("sparse", "mixed")):
                continue
            if opt == "sparseadam" and not sparse_grad:
                continue  # SparseAdam needs sparse gradients, as on one device
            index = len(cases)
            cases.append(Case(model, opt, sparse_grad, clip, dtype,
                              num_partitions=(None, 3, 5)[index % 3],
                              scheduler=(opt == "adagrad"), seed=index))
    # The documented sum semantics, and DDP's sum hook.
    for model, opt in (("mixed", "adam"), ("sparse", "sgd"), ("gather", "momentum")):
        for clip in (None, 0.05):
            cases.append(Case(model, opt, clip=clip, average_sparse=False,
                              average_dense=False, seed=len(cases)))
            cases.append(Case(model, opt, clip=clip, average_sparse=False, seed=len(cases)))
    # The other architectures, and local aggregation switched off and on explicitly: every
    # model and optimizer in float64, where nothing hides in rounding.
    variants = [("hybrid", False), ("allreduce", None), ("ps", None), ("optps", None),
                ("ps", True), ("optps", False)]
    for (architecture, aggregation), model, opt, clip in itertools.product(
            variants, MODELS, MATRIX_OPTIMIZERS, (None, 0.05)):
        sparse_grad = opt == "sparseadam"
        if sparse_grad and model not in ("sparse", "mixed"):
            continue
        if architecture in ("ps", "optps") and opt == "sparseadam" and model == "mixed":
            continue  # the dense part needs Adam: covered by the other variants
        if aggregation is not None and opt not in ("sgd", "adagrad", "adam"):
            continue
        cases.append(Case(model, opt, sparse_grad, clip, "float64",
                          num_partitions=(None, 3)[len(cases) % 2], architecture=architecture,
                          local_aggregation=aggregation, seed=len(cases)))
    # The hybrid moving every sparse table, values and optimizer state, to AllReduce after
    # measuring α in the first steps: training goes on exactly as on one device.
    for model, opt, clip, dtype in itertools.product(
            ("sparse", "mixed", "gather"), MATRIX_OPTIMIZERS, (None, 0.05), ("float64", "float32")):
        sparse_grad = opt == "sparseadam"
        if (sparse_grad and model == "gather") or (dtype == "float32" and clip is None):
            continue
        cases.append(Case(model, opt, sparse_grad, clip, dtype, migrate_after=2 + len(cases) % 2,
                          scheduler=opt == "adagrad", seed=len(cases)))
    # Lazy updates: a dense-gradient embedding trained as if it had sparse=True.
    for architecture, model, opt, clip in itertools.product(
            ("hybrid", "allreduce", "optps"), ("sparse", "mixed"),
            ("sgd", "adagrad", "sparseadam"), (None, 0.05)):
        cases.append(Case(model, opt, False, clip, "float64", architecture=architecture,
                          lazy=True, seed=len(cases)))
    # Re-partitioning in the middle of training (values and optimizer state move): as if
    # nothing happened.
    for (architecture, aggregation), model, opt in itertools.product(
            (("hybrid", None), ("ps", None), ("hybrid", False)), ("sparse", "mixed", "gather"),
            ("sgd", "momentum", "adagrad", "adam", "sparseadam")):
        sparse_grad = opt == "sparseadam"
        if sparse_grad and (model == "gather" or (architecture == "ps" and model == "mixed")):
            continue
        cases.append(Case(model, opt, sparse_grad, 0.05 if len(cases) % 2 else None,
                          "float64", num_partitions=2, architecture=architecture,
                          local_aggregation=aggregation,
                          repartition=(2 + len(cases) % 2, (5, 3, 1)[len(cases) % 3]),
                          seed=len(cases)))
    # The partition-count search in the middle of training: each sample re-partitions the
    # tables, as if nothing happened.
    for (architecture, aggregation), model, opt in itertools.product(
            (("hybrid", None), ("optps", None), ("hybrid", False)), ("sparse", "mixed"),
            ("momentum", "adagrad", "adam", "sparseadam")):
        sparse_grad = opt == "sparseadam"
        if sparse_grad and architecture == "optps" and model == "mixed":
            continue
        cases.append(Case(model, opt, sparse_grad, 0.05 if len(cases) % 2 else None,
                          "float64", architecture=architecture, local_aggregation=aggregation,
                          search=("context", "call")[len(cases) % 2], steps=10,
                          seed=len(cases)))
    # Every lookup option; max_norm and scale_grad_by_freq over the global batch wherever the
    # table lives: on servers (with and without local aggregation), replicated (AllGatherv),
    # and moved to AllReduce by the hybrid after measuring α; max_norm also with sparse
    # gradients and lazy updates.
    variants = [("hybrid", None, 0), ("hybrid", False, 0), ("allreduce", None, 0),
                ("ps", None, 0), ("optps", None, 0), ("hybrid", None, 2)]
    for (architecture, aggregation, migrate), model, opt in itertools.product(
            variants, OPTION_MODELS, ("sgd", "momentum", "adagrad", "adam")):
        cases.append(Case(model, opt, False, 0.05 if len(cases) % 2 else None, "float64",
                          num_partitions=(None, 3)[len(cases) % 2], architecture=architecture,
                          local_aggregation=aggregation, migrate_after=migrate,
                          seed=len(cases)))
    for architecture in ("hybrid", "allreduce", "optps"):
        cases.append(Case("maxnorm", "sgd", True, None, "float64", architecture=architecture,
                          seed=len(cases)))
        cases.append(Case("maxnorm", "adagrad", False, 0.05, "float64",
                          architecture=architecture, lazy=True, seed=len(cases)))
    # Adagrad's initial_accumulator_value on the servers, on every architecture.
    for architecture in ("hybrid", "allreduce", "ps", "optps"):
        for model in ("mixed", "gather"):
            cases.append(Case(model, "adagrad-init", clip=0.05, dtype="float64",
                              architecture=architecture, seed=len(cases)))
    # Every dense-synchronisation strategy (Config.dense_sync), averaged and summed.
    for architecture, model, opt, average in itertools.product(
            ("hybrid", "allreduce"), ("dense", "mixed"), ("momentum", "adam"), (True, False)):
        cases.append(Case(model, opt, clip=0.05 if average else None, dtype="float64",
                          architecture=architecture, average_dense=average, dense_sync="flat",
                          seed=len(cases)))
    # The user's own loop (parallax.distribute): every architecture, optimizer and clipping
    # through the model/optimizer surface, then the loop shapes of LOOPS.
    for architecture, opt in itertools.product(("hybrid", "allreduce", "ps", "optps"),
                                               MATRIX_OPTIMIZERS):
        if opt == "sparseadam" and architecture in ("ps", "optps"):
            continue  # the dense part needs Adam: covered under hybrid/allreduce
        for clip in (None, 0.05):
            cases.append(Case("mixed", opt, opt == "sparseadam", clip, "float64",
                              architecture=architecture, loop="plain", seed=len(cases)))
    for architecture, opt in itertools.product(("hybrid", "allreduce", "ps", "optps"),
                                               ("adagrad", "adam")):
        cases.append(Case("mixed", opt, clip=0.05, dtype="float64", architecture=architecture,
                          loop="accumulate", seed=len(cases)))
        cases.append(Case("lstm", opt, clip=0.05 if opt == "adam" else None, dtype="float64",
                          architecture=architecture, loop="bptt", seed=len(cases)))
    for architecture, opt in itertools.product(("hybrid", "allreduce"), ("momentum", "adam")):
        cases.append(Case("mixed", opt, dtype="float64", architecture=architecture,
                          loop="extra", seed=len(cases)))
        cases.append(Case("mixed", opt, clip=0.05, dtype="float64", architecture=architecture,
                          loop="closure", seed=len(cases)))
    cases.append(Case("mixed", "sparseadam", True, 0.05, "float64", loop="accumulate",
                      seed=len(cases)))  # two optimizers, two micro-batches
    for architecture, opt in itertools.product(("hybrid", "allreduce", "ps", "optps"),
                                               ("adam", "adagrad")):
        cases.append(Case("mixed", opt, clip=0.05 if opt == "adam" else None, dtype="float32",
                          architecture=architecture, loop="scaler", steps=8, seed=len(cases)))
    cases.append(Case("mixed", "sparseadam", True, 0.05, "float32", loop="scaler", steps=8,
                      seed=len(cases)))
    # Built in parallax.meta_init: every server makes its own rows, every worker the rest, to
    # the single-device program's initial values (then trains as it does).
    for architecture, model, opt in (
            ("hybrid", "mixed", "adagrad-init"), ("hybrid", "bags", "adam"),
            ("hybrid", "gather", "momentum"), ("allreduce", "mixed", "adagrad-init"),
            ("ps", "bags", "adam"), ("optps", "gather", "momentum")):
        cases.append(Case(model, opt, clip=0.05, dtype="float64", architecture=architecture,
                          meta=True, seed=len(cases)))
    cases.append(Case("mixed", "sparseadam", True, None, "float32", meta=True, seed=len(cases)))
    cases.append(Case("lstm", "adam", clip=0.05, dtype="float64", loop="bptt", meta=True,
                      seed=len(cases)))
    cases.append(Case("sparse", "adagrad", migrate_after=2, meta=True, seed=len(cases)))
    # Seed 001's operation placements moved back, for its ablation (the aggregates' element-
    # wise operations on the workers, the ids' dedup on the servers): they move work, not
    # what it computes. Each architecture with servers, local aggregation on and off,
    # clipping, sparse gradients, lookup options and summed rows among them.
    placements = (("workers", "workers"), ("servers", "servers"), ("workers", "servers"))
    for i, ((architecture, aggregation), (after, dedup)) in enumerate(itertools.product(
            (("hybrid", None), ("ps", False), ("optps", True)), placements)):
        model, opt = (("mixed", "adagrad"), ("sparse", "adam"), ("gather", "momentum"))[i % 3]
        cases.append(Case(model, opt, clip=0.05 if i % 2 else None, dtype="float64",
                          num_partitions=(None, 3)[i % 2], architecture=architecture,
                          local_aggregation=aggregation, after_aggregation=after,
                          id_dedup=dedup, seed=len(cases)))
    for model, opt, sparse_grad, clip in (("sparse", "sparseadam", True, 0.05),
                                          ("freq", "adagrad", False, None),
                                          ("maxnorm", "sgd", False, 0.05),
                                          ("bags", "adam", False, 0.05)):
        cases.append(Case(model, opt, sparse_grad, clip, "float64", after_aggregation="workers",
                          id_dedup="servers", seed=len(cases)))
    cases.append(Case("mixed", "sgd", clip=0.05, dtype="float64", average_sparse=False,
                      architecture="ps", after_aggregation="workers", id_dedup="servers",
                      seed=len(cases)))
    # Summed gradients under every architecture.
    for architecture in ("allreduce", "ps", "optps"):
        cases.append(Case("mixed", "momentum", clip=0.05, average_sparse=False,
                          average_dense=False, architecture=architecture, seed=len(cases)))
    return cases


# Variants whose keys the plan test leaves out (their plans differ from the plain case's).
PLAN_VARIANTS = ("migrate", "lazy", "repartition", "search", "loop", "meta")


def _read_by_every_shape(cases: list[Case]) -> set[str]:
    """The cases the plan and search tests read on every cluster shape: each architecture x
    model's last plain case, every search case, and the first migrate case with sparse and
    with dense gradients (the plan test's two placements after a move; the other migrate
    cases run in their shapes' share of the matrix)."""
    plain = {}
    for case in cases:
        if not any(variant in case.key for variant in PLAN_VARIANTS):
            plain[(case.architecture, case.model)] = case.key
    migrated = {}
    for case in cases:
        if case.migrate_after:
            migrated.setdefault(case.sparse_grad, case.key)
    return set(plain.values()) | set(migrated.values()) | {c.key for c in cases if c.search}


def sampled_cases(every: int = 3, offset: int = 0) -> list[Case]:
    """A ``1/every`` sample of the matrix for the one-machine shapes (1x1, 1x2): every
    ``every``-th case from the ``offset``-th (shapes given other offsets run other cases),
    plus what the plan and search tests read on every shape."""
    cases = all_cases()
    wanted = _read_by_every_shape(cases)
    return [case for i, case in enumerate(cases)
            if i % every == offset % every or case.key in wanted]


#: what each half of the matrix (`half_of_matrix`) holds every value of: each field alone,
#: and each architecture with each value of the other fields
COVERED_FIELDS = ("architecture", "model", "optimizer", "sparse_grad", "clip", "dtype",
                  "average_sparse", "average_dense", "num_partitions", "scheduler",
                  "dense_sync", "loop", "local_aggregation", "migrate_after", "lazy",
                  "repartition", "search", "meta", "after_aggregation", "id_dedup")


def coverage_keys(case: Case) -> set[tuple]:
    """The (field, value) and (architecture, field, value) facts a half must cover."""
    keys = set()
    for name in COVERED_FIELDS:
        value = getattr(case, name)
        keys.add((name, value))
        keys.add((case.architecture, name, value))
    return keys


def half_of_matrix(half: int) -> list[Case]:
    """Part ``half`` (0 or 1) of the matrix for the cross-machine shapes (2x1 runs part 0,
    2x2 part 1; PARALLAX_FULL_MATRIX=1 runs all of it on both): the cases whose key hashes
    (CRC-32, stable across runs) into the part, five sixths of them into part 0 and one
    into part 1 (a case costs 2x2's four processes on the suite's 2 cores about three times
    2x1's two: 0.62 against 0.22 s), plus what the plan and search tests read on every
    shape, plus, for every field value and every architecture's field value that the hash
    left out, the first case that has it. So the parts together run every case across
    machines, and each alone still meets every value of every option."""
    cases = all_cases()
    chosen = _read_by_every_shape(cases) | {
        c.key for c in cases if (zlib.crc32(c.key.encode()) % 6 == 5) == (half == 1)}
    covered = set().union(*(coverage_keys(c) for c in cases if c.key in chosen))
    for case in cases:
        missing = coverage_keys(case) - covered
        if missing:
            chosen.add(case.key)
            covered |= missing
    return [case for case in cases if case.key in chosen]


# ---- data, model and program -----------------------------------------------------------------
def global_batches(case: Case) -> list[tuple[Tensor, Tensor]]:
    """``case.steps`` global batches of GLOBAL_BATCH samples, deterministic per case."""
    gen = torch.Generator().manual_seed(1000 + case.seed)
    batches = []
    for _ in range(case.steps):
        if case.model == "dense":
            x = torch.randn(GLOBAL_BATCH, 6, generator=gen, dtype=case.torch_dtype)
        else:
            # Zipf-like ids: small ids are frequent, as in real vocabularies.
            u = torch.rand(GLOBAL_BATCH, SEQ, generator=gen, dtype=torch.float64)
            x = (VOCAB ** u - 1).long().clamp(0, VOCAB - 1)
        if case.model in ("tied", "lstm"):
            y = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=gen)
        else:
            y = torch.randint(0, 4, (GLOBAL_BATCH,), generator=gen)
        batches.append((x, y))
    return batches


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def build(case: Case, *, reference: bool = False,
          ) -> tuple[nn.Module, list[torch.optim.Optimizer], list]:
    """The case's model and optimizers; the single-device ``reference`` of a lazy case has
    sparse=True embeddings (what lazy updates are defined to equal)."""
    torch.manual_seed(case.seed)
    sparse_grad = case.sparse_grad or (reference and case.lazy)
    model_class = {**MODELS, **OPTION_MODELS, **LOOP_MODELS}[case.model]
    deferred = case.meta and not reference
    with parallax.meta_init(threshold_bytes=0) if deferred else contextlib.nullcontext():
        model = model_class(sparse_grad=sparse_grad).to(case.torch_dtype)
    optimizers = OPTIMIZERS[case.optimizer](model)
    schedulers = ([torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in optimizers]
                  if case.scheduler else [])
    return model, optimizers, schedulers


def worker_slice(batch: tuple[Tensor, Tensor], rank: int, world: int) -> tuple[Tensor, Tensor]:
    per = GLOBAL_BATCH // world
    x, y = batch
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def clip_like_parallax(parameters: list[nn.Parameter], max_norm: float) -> float:
    """``clip_grad_norm_`` that also takes sparse (COO) gradients, which torch's refuses."""
    grads = [p.grad.coalesce() if p.grad.is_sparse else p.grad
             for p in parameters if p.grad is not None]
    norms = [torch.linalg.vector_norm(g._values() if g.is_sparse else g, dtype=torch.float64)
             for g in grads]
    total = torch.linalg.vector_norm(torch.stack(norms))
    factor = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in parameters:
        if p.grad is not None:
            p.grad = p.grad.coalesce() if p.grad.is_sparse else p.grad
            p.grad.mul_(factor.to(p.grad.dtype))
    return float(total)


def single_device_reference(case: Case, world: int) -> dict[str, Tensor]:
    """The plain program with the global batch. ``world`` matters only for the documented sum
    semantics: summed gradients are ``world`` times the mean-loss gradients."""
    model, optimizers, schedulers = build(case, reference=True)
    if case.loop:
        return _loop_reference(case, model, optimizers, world)
    sparse_names = _sparse_names(model)
    for x, y in global_batches(case):
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        for name, p in model.named_parameters():
            if p.grad is None:
                continue
            sparse = name in sparse_names
            if (sparse and not case.average_sparse) or (not sparse and not case.average_dense):
                p.grad = p.grad * world
        if case.clip is not None:
            norm = clip_like_parallax(list(model.parameters()), case.clip)
            assert norm > case.clip, "clipping must be active for the test to mean anything"
        for opt in optimizers:
            opt.step()
        for sched in schedulers:
            sched.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def micro_batches(batch: tuple[Tensor, Tensor], case: Case, world: int,
                  ) -> list[tuple[Tensor, Tensor]]:
    """A batch as the micro-batches of a loop: two halves of every worker's slice under
    ``accumulate`` (micro-batch j of the global batch = every worker's half j), else whole."""
    if case.loop != "accumulate":
        return [batch]
    x, y = batch
    per = x.shape[0] // world
    halves = [[r * per + j * (per // 2) + i for r in range(world) for i in range(per // 2)]
              for j in range(2)]
    return [(x[rows], y[rows]) for rows in halves]


def loop_loss(case: Case, model: nn.Module, output: Tensor, y: Tensor, parts: int) -> Tensor:
    """The loss a loop case backpropagates (``model``: whose dense ``hidden`` weight the
    extra term reads; the user's module or the distributed one)."""
    loss = loss_fn(output, y.to(output.device)) / parts  # as a GPU program moves its targets
    if case.loop == "scaler":  # x 256: scales near 2**120 overflow float32 now and then
        loss = loss * 256
    if case.loop == "extra":
        loss = loss + EXTRA_TERM * model.hidden.weight.pow(2).sum()
    return loss


def _loop_reference(case: Case, model: nn.Module, optimizers: list[torch.optim.Optimizer],
                    world: int) -> dict[str, Tensor]:
    """The single-device program of a loop case on the global batches."""
    scaler = torch.amp.GradScaler("cpu", **SCALER) if case.loop == "scaler" else None
    train_loop(case, model, optimizers,
               (micro_batches(batch, case, world) for batch in global_batches(case)),
               clip=lambda params, max_norm: clip_like_parallax(list(params), max_norm),
               scaler=scaler)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_loop(case: Case, model: nn.Module, optimizers: list[torch.optim.Optimizer],
               steps: Iterable[list[tuple[Tensor, Tensor]]], *,
               clip: Callable[[Iterable[nn.Parameter], float], object],
               scaler: torch.amp.GradScaler | None = None) -> None:
    """A loop case's program, one step per item of ``steps`` (its micro-batches). The same
    code trains on one device and, on every worker, through parallax.distribute: only the
    model, optimizers, ``clip`` (parallax.clip_grad_norm_) and ``scaler`` (parallax's) differ,
    as in a user's program."""
    hidden = None
    for parts in steps:
        def closure(parts: list[tuple[Tensor, Tensor]] = parts) -> None:
            for opt in optimizers:
                opt.zero_grad()
            for x, y in parts:
                loop_loss(case, model, model(x), y, len(parts)).backward()
            if case.clip is not None:
                clip(model.parameters(), case.clip)

        if case.loop == "closure":
            (optimizer,) = optimizers
            optimizer.step(closure)
            continue
        for opt in optimizers:
            opt.zero_grad()
        for i, (x, y) in enumerate(parts):
            # accumulating under DDP-like models: no_sync for all but the last micro-batch
            no_sync = getattr(model, "no_sync", None)
            with no_sync() if no_sync and i < len(parts) - 1 else contextlib.nullcontext():
                if case.loop == "bptt":
                    output, hidden = model(x, hidden)
                    hidden = tuple(h.detach() for h in hidden)
                else:
                    output = model(x)
                loss = loop_loss(case, model, output, y, len(parts))
                (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            for opt in optimizers:
                scaler.unscale_(opt)
        if case.clip is not None:
            clip(model.parameters(), case.clip)
        for opt in optimizers:
            scaler.step(opt) if scaler else opt.step()
        if scaler:
            scaler.update()


def _sparse_names(model: nn.Module) -> set[str]:
    from parallax.model.detect import find_sparse_parameters

    return set(find_sparse_parameters(model))
