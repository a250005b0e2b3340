"""`Config`: every knob of a parallax run, validated before any process starts."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib.util
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from enum import StrEnum
from typing import Any, TypeVar

from parallax.checks import is_int, is_number
from parallax.errors import ConfigError

T = TypeVar("T")


class ArchitectureName(StrEnum):
    """The architectures `Config.architecture` names; each is a class in
    `parallax.planning.architectures` (its registry is keyed by these)."""

    HYBRID = "hybrid"
    ALLREDUCE = "allreduce"
    PS = "ps"
    OPTPS = "optps"


class DenseSyncName(StrEnum):
    """How replicated dense parameters are synchronised (`Config.dense_sync`); each is a
    strategy in `parallax.engine.dense_sync` (its registries are keyed by these)."""

    HIERARCHICAL = "hierarchical"
    FLAT = "flat"
    QSGD = "qsgd"
    PLUMP = "plump"
    SLIM = "slim"


class ParallelismName(StrEnum):
    """How the dense layers are laid out (`Config.parallelism`); each is a strategy in
    `parallax.parallelism`."""

    DATA = "data"
    MODEL = "model"
    TWO_D = "2d"
    AUTO = "auto"


class ModelSplitName(StrEnum):
    """How ``parallelism`` ``"model"``/``"2d"``/``"auto"`` split the linear layers
    (`Config.model_split`; `parallax.parallelism.splits`)."""

    PAIRS = "pairs"
    EVERY_LAYER = "every-layer"


class ShardingName(StrEnum):
    """How a server-held table's rows are held and read (`Config.sharding`; the kinds are
    `parallax.engine.tables.sharding`)."""

    ROWS = "rows"
    POOLED = "pooled"
    POOLED_BY_ROWS = "pooled_by_rows"
    POOLED_BY_COLUMNS = "pooled_by_columns"


#: the key of `Config.sharding` that pins every table the mapping does not name
EVERY_OTHER_TABLE = "*"


class Pins(Mapping[str, ShardingName]):
    """`Config.sharding` as kept: read-only, and hashable as the rest of a `Config` is."""

    def __init__(self, pins: Mapping[str, str]) -> None:
        self._pins = {name: ShardingName(kind) for name, kind in pins.items()}

    def __getitem__(self, name: str) -> ShardingName:
        return self._pins[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._pins)

    def __len__(self) -> int:
        return len(self._pins)

    def __hash__(self) -> int:
        return hash(frozenset(self._pins.items()))

    def __repr__(self) -> str:
        return repr({name: str(kind) for name, kind in self._pins.items()})


class SyncName(StrEnum):
    """When updates apply (`Config.sync`); the asynchronous ones are
    `parallax.engine.asynchronous.async_training`."""

    SYNC = "sync"
    ASYNC = "async"
    ASYNC_SPARSE = "async-sparse"


class PlacementName(StrEnum):
    """The side that runs an operation seed 001's operation placement moves
    (`Config.after_aggregation`, `Config.id_dedup`)."""

    SERVERS = "servers"
    WORKERS = "workers"


PLACEMENTS = tuple(str(p) for p in PlacementName)

#: dense syncs that move the workers' updates through servers instead of AllReducing gradients
SERVER_SYNCS = (DenseSyncName.PLUMP, DenseSyncName.SLIM)


def _fields_by_name(cls: type[T]) -> type[T]:
    """A misspelt keyword (``Config(clip_grad_nrom=1.0)``) is a `ConfigError` naming it and
    the nearest field, not the dataclass's bare ``TypeError``."""
    init = cls.__init__
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]

    @functools.wraps(init)
    def checked(self: Any, *args: Any, **kwargs: Any) -> None:
        for key in kwargs:
            if key not in names:
                near = difflib.get_close_matches(key, names, n=1)
                hint = f" (did you mean {near[0]!r}?)" if near else ""
                raise ConfigError(f"{cls.__name__} has no field {key!r}{hint}; its fields: "
                                  f"{', '.join(names)}")
        init(self, *args, **kwargs)

    cls.__init__ = checked  # type: ignore[method-assign]  # wrapping the dataclass's
    return cls


@_fields_by_name
@dataclass(frozen=True)
class QSGD:
    """Random quantisation of dense gradients or updates (QSGD, Alistarh et al.): each bucket of
    ``bucket_size`` values travels as its L2 norm and one signed level in
    ``[-s, s]`` per value, ``s = 2**(bits-1) - 1``, rounded up or down at random so the decoded
    vector is an unbiased estimate (variance at most ``min(d/s², √d/s)·‖v‖²`` per bucket of
    ``d`` values). ``bits`` is 2, 4 or 8 (the paper's 8-bit, bucket 512 is the default).

    What the bound means for the learning rate, at the default bucket of 512: 8 bits (s = 127)
    add at most 0.03·‖v‖² of variance, so the single-device learning rate serves; 4 bits
    (s = 7) up to 3.2·‖v‖², and 2 bits (s = 1) up to 22.6·‖v‖², several times the gradient's
    own size: scale the learning rate down (by about the square root of 1 + the bound is a
    start) or use smaller buckets (``bucket_size=16`` bounds 2 bits at 4·‖v‖²)."""

    bits: int = 8
    bucket_size: int = 512

    def __post_init__(self) -> None:
        _require(self.bits in (2, 4, 8) and is_int(self.bits), "qsgd.bits", self.bits,
                 "2, 4 or 8")
        _require(is_int(self.bucket_size) and self.bucket_size >= 1, "qsgd.bucket_size",
                 self.bucket_size, "an int >= 1")


@_fields_by_name
@dataclass(frozen=True)
class SlimDP:
    """Slim-DP's significance-aware partial synchronisation (`Config.dense_sync` ``"slim"``).

    Each server keeps a *core*: the ``beta`` share of its dense values most significant by
    ``|w| + significance·|Δw|`` (``significance`` weighs the update), re-selected every
    ``reselect_every`` communications. Each worker adds a random *explorer* of ``alpha - beta``
    of the other values (``alpha``: the share that travels in all), re-drawn every
    communication; it pushes the core's and the explorer's accumulated updates and pulls their
    values. Every ``reselect_every``-th communication (the last before a re-selection) pushes
    and pulls everything. Workers communicate every ``sync_every`` local steps. The paper's
    defaults: alpha 0.2, beta 0.1 (VGG-16), p = 1; its q (20k-50k mini-batches) is far longer
    than our runs, hence 20; a ``reselect_every`` above the run's rounds is the paper's regime
    (the core chosen once, from ``|w|``, and no full round). Its ablations: ``beta=0`` (no
    core: each round syncs a fresh random ``alpha`` share, DropConnect-like) and
    ``beta=alpha`` (no explorer: the core alone)."""

    alpha: float = 0.2
    beta: float = 0.1
    reselect_every: int = 20
    sync_every: int = 1
    significance: float = 1.0

    def __post_init__(self) -> None:
        _require(is_number(self.beta) and 0 <= self.beta <= 1, "slim.beta", self.beta,
                 "a number in [0, 1]")
        _require(is_number(self.alpha) and self.beta <= self.alpha <= 1, "slim.alpha",
                 self.alpha, f"a number in [beta, 1] = [{self.beta}, 1]")
        for name in ("reselect_every", "sync_every"):
            value = getattr(self, name)
            _require(is_int(value) and value >= 1, f"slim.{name}", value, "an int >= 1")
        _require(is_number(self.significance) and math.isfinite(self.significance)
                 and self.significance >= 0, "slim.significance", self.significance,
                 "a finite number >= 0")


ARCHITECTURES = tuple(a.value for a in ArchitectureName)
PARALLELISMS = tuple(p.value for p in ParallelismName)
DENSE_SYNCS = tuple(d.value for d in DenseSyncName)
NONFINITE = ("raise", "skip", "ignore")
SYNCS = tuple(m.value for m in SyncName)


@_fields_by_name
@dataclass(frozen=True)
class Config:
    """How parallax trains. Defaults reproduce the single-device program with the global batch.

    Attributes:
        architecture: how parameters are synchronised.
            ``"hybrid"`` (default): dense parameters AllReduced (DDP), sparse ones on parameter
            servers with local aggregation. ``"allreduce"`` (the Horovod way): every parameter
            replicated; sparse gradients exchanged by AllGatherv of (ids, rows).
            ``"ps"`` (naive parameter server): every parameter, dense ones too, on servers.
            ``"optps"``: ``"ps"`` with local aggregation.
        dense_sync: how replicated dense parameters are synchronised (under ``hybrid`` and
            ``allreduce``; under ``ps``/``optps`` they live on the servers).
            Gradients AllReduced through DDP (Plump-DP by AllReduce; equal to one device):
            ``"hierarchical"`` (default): reduced inside each machine, a ring among the
            machines' leaders, broadcast back (Table 3's AllReduce bytes, which the plan
            predicts). ``"flat"``: one ring over all ranks, as DDP does by default.
            ``"qsgd"`` (Quant-DP): each rank's gradient quantised by `Config.qsgd`, the codes
            all-gathered and decoded (a sum of codes is no code): unbiased, not exact.
            Updates through servers (the workers run the optimizer on their own gradients;
            needs ``torch.optim.SGD`` for those parameters): ``"plump"`` (Plump-DP): every
            ``slim.sync_every`` steps each worker pushes its whole update to the servers and
            pulls the whole model (with ``sync_every=1``, equal to one device);
            ``"slim"`` (Slim-DP): only a core and an explorer travel (`Config.slim`).
            With ``Config.qsgd`` set, their pushes are quantised (Quant-DP through servers).
        sync: when updates apply. ``"sync"`` (default): every step's gradients of all workers
            are aggregated, then applied once (equal to one device). ``"async"`` (asynchronous
            parameter servers; needs ``architecture="ps"``): every parameter lives on the
            servers, each worker pulls, computes and pushes on its own clock and a server
            applies each push when it arrives, with the user's optimizer (one update per push,
            the gradient divided by the worker count when averaging). ``"async-sparse"``
            (Persia's hybrid; needs ``architecture="hybrid"``): dense parameters stay
            synchronous (AllReduce), the server-held sparse rows are pulled and pushed
            asynchronously. Under both: gradient clipping (``"async"`` only) and the
            non-finite check act on each worker's own push; no partition search; the plan's
            tables stay on the servers. README "Asynchronous training" says what changes.
        max_staleness: with an asynchronous ``sync``, how many steps a worker may run ahead
            of the slowest one before its next pull waits (``None``: no bound). ``0`` is
            synchronous training through the asynchronous servers: each server applies a
            step once every worker pushed it, as one update (equal to ``sync="sync"``).
        qsgd: the quantiser of ``dense_sync="qsgd"`` (default `QSGD()` there), and of the
            pushes of ``"plump"``/``"slim"`` when set.
        slim: Slim-DP's α, β, q, p and c (`SlimDP`); ``"plump"`` uses its ``sync_every``.
        parallelism: how the dense layers are laid out over the workers
            (`parallax.parallelism`). ``"data"`` (default): whole on every worker.
            ``"model"``: every ``nn.Linear`` split over all workers (pairs of linear layers
            around element-wise activations split column- then row-wise, others by output
            neurons with their outputs gathered), all of them reading the same batch.
            ``"2d"``: the grid ``mesh = (data, model)``: the batch split over ``data``
            groups, the layers over ``model`` groups of consecutive ranks. ``"auto"``: the grid
            the cost model predicts fastest (α, β measured at start-up, the compute of each
            grid's matrix products timed; needs a `parallax.shard` loader created first, for
            the global batch); prints its table on rank 0. Every grid trains the same global
            batch (the workers of a model group read together what they would read under
            ``"data"``). Needs ``architecture="hybrid"`` (the sparse path still runs beside
            it) and ``dense_sync`` ``"hierarchical"`` or ``"flat"``.
        mesh: the ``(data, model)`` degrees of ``parallelism="2d"`` (their product is the
            number of workers).
        model_split: how ``parallelism`` ``"model"``, ``"2d"`` and ``"auto"`` split the linear
            layers. ``"pairs"`` (default): Megatron-LM's column-then-row pairs (one
            all-reduce per pair each way). ``"every-layer"``: every layer split by output
            neurons and its output all-gathered (the scheme of the model/integrated
            parallelism report; a baseline: more collectives, the same parameters).
        local_aggregation: workers of one machine merge their ids and sum their gradient rows
            before anything crosses machines. ``None``: on for ``optps``, off for ``ps``; the
            ``hybrid`` starts with it and keeps it once α is measured only if merging saves
            at least 20 % of the predicted bytes (``MIN_AGGREGATION_SAVING``: the extra hop costs
            time too), and where it keeps it, times `local_aggregation_trial_steps` steps with
            the hop and as many without and keeps the faster; it does not apply to
            ``allreduce``.
        local_aggregation_trial_steps: steps timed with and then without the leader hop
            where the ``hybrid``'s bytes rule keeps it (the first half of each sample is
            discarded; the slowest rank's mean decides). 0: the bytes rule alone decides.
        sparsity_warmup_steps: α of every sparse parameter is measured over the first this
            many training steps; then the plan is completed (and, under ``hybrid``, a sparse
            parameter with α above the threshold moves to AllReduce). 0: never measure.
        alpha_threshold: that threshold. ``None``: no fixed threshold; a table moves when the
            bytes model (`parallax.planning.cost`), fed with its measured α (α_m of the machines'
            merged
            rows under local aggregation), predicts AllReduce to move fewer bytes than the PS,
            and always with one worker under `Runner.step` (no exchange at all; the own loop
            of `parallax.distribute` keeps its tables on the servers).
        lazy_sparse_updates: treat every sparse parameter as if its layer had ``sparse=True``:
            servers update only the rows a step touched, instead of moving every row as a
            dense-gradient embedding does on one device under Adagrad/momentum (exact, but its
            cost grows with the table). Training then equals the single-device program with
            ``sparse=True`` embeddings; needs SGD, Adagrad or SparseAdam for those parameters.
        overlap_push: in `Runner.step`, send each pull's gradient rows to the servers as soon
            as the backward has produced them (an async exchange that overlaps the rest of
            the backward and DDP's AllReduce; `parallax.engine.tables.early_push`), with the same
            results. False: push after the backward. A loop of your own
            (`parallax.distribute`) always pushes after the backward, in ``optimizer.step()``:
            it may call backward more than once per step.
        average_dense: divide AllReduced dense gradients by the number of workers (mean of the
            per-worker gradients, as DDP does). False sums them.
        average_sparse: servers divide the aggregated sparse gradient rows by the number of
            workers. False sums them: the sparse gradient is then ``world_size`` times the
            single-device gradient of the global batch.
        clip_grad_norm: if set, clip by the global L2 norm of the *aggregated* dense and sparse
            gradients (as ``torch.nn.utils.clip_grad_norm_`` would on one device), before any
            update.
        after_aggregation: where the element-wise operations on a server-held table's
            aggregated gradient run (the average over the workers and a clip's scale):
            ``"servers"`` (default: beside the aggregate, seed 001's +OPAU) or ``"workers"``
            (the placement without it, for that ablation: each server sends its aggregated
            rows to every worker, which applies them, and takes the result back from the
            next rank; the same results, more traffic). Synchronous training only.
        id_dedup: which side deduplicates a step's ids of a server-held table and sums the
            gradient rows of its repeated ids: ``"workers"`` (default: the side whose data is
            smaller, seed 001's +OPSW) or ``"servers"`` (the placement without it, for that
            ablation: every looked-up id travels, a row per lookup comes back and a gradient
            row per lookup goes out; the same results, more traffic; a machine's leader
            under local aggregation still merges its workers' ids). Synchronous training
            only.
        seed: seed of the data sharding order and of ``torch.manual_seed`` in every worker
            under `get_runner` (`distribute` leaves the program's generator as it was).
        num_partitions: row partitions per sparse parameter; partition ``p`` holds the rows with
            ``id % num_partitions == p`` and lives on server ``p % num_servers``. ``None`` means
            one partition per server.
        pooled_tables: parameter names of ``nn.EmbeddingBag`` tables to hold whole on one
            server each (TorchRec's table-wise sharding) and pool there: a worker sends its
            ids and offsets to the owner and gets one pooled vector per bag back, and sends
            that vector's gradient back after the backward, instead of pulling every row its
            bags read and pushing every row's gradient (`parallax.engine.tables.pooled`).
            Also ``nn.Embedding`` tables (and parameters read by hand-written gathers) whose
            rows the program only sums or averages over each row of ids
            (``emb(ids).mean(1)``, ``w[ids].sum(1)``; no ``padding_idx``): each row of ids is a
            bag, and any other use of the rows is refused naming the table
            (`parallax.model.bag_reductions`; the hybrid takes such a table by itself only
            where the warm-up saw nothing but those sums and means).
            Fewer bytes for long bags over big tables; exact like the row path. Owners are
            chosen largest table first onto the least loaded server; the plan shows them.
            ``None`` (default): the hybrid decides after the warm-up, per bag table, from its
            measured ids and bags per step (`Hybrid.pools_bags`: pooling must move fewer bytes
            than the rows, which move at least ``MIN_POOLED_ROWS_BYTES`` per machine and step,
            and the whole table with its gradient and optimizer state fits in what its owner
            may still allocate; a table that fits no server whole is pooled by rows or cut
            into column slices, whichever the bytes model predicts cheaper, where that moves
            fewer bytes than its rows);
            ``()``: never. Not for tables with ``max_norm`` or ``scale_grad_by_freq``,
            per-sample weights that require a gradient, ``architecture="allreduce"`` or an
            asynchronous ``sync``; a pooled table is never re-partitioned nor moved to
            AllReduce.
        pooled_by_rows: parameter names of ``nn.EmbeddingBag`` tables (or ``nn.Embedding``
            tables as `pooled_tables` takes them) pooled where their rows
            live, partitioned over every server as on the row path (TorchRec's row-wise
            sharding): a worker sends each server the ids of its rows, each server pools its
            share of every bag (a sum) and sends it back, and the worker adds the shares (and
            divides by the bag's size under ``mode="mean"``); the shares' gradients go back
            after the backward. One big table's pooling is spread over every server, for one
            pooled vector per server and bag; equal to one device up to the order in
            which a bag's rows are added. Not with ``mode="max"`` nor where `pooled_tables`
            would refuse; distinct from `pooled_tables`' names.
        pooled_by_columns: parameter names of ``nn.EmbeddingBag`` tables (or ``nn.Embedding``
            tables as `pooled_tables` takes them) held as column
            slices (TorchRec's column-wise sharding): a table of width d is cut into the most
            slices K that divide d, at most one per server, slice k on its own server; a
            worker sends every slice's server all its ids and offsets, each pools its slice
            of every bag (any ``mode``, per-sample weights too) and the worker puts the
            slices side by side; their gradients go back after the backward. One table's
            memory, pooling and update spread over K servers, for ids sent K times; exact
            like the row path (`parallax.engine.tables.columns`). Refused where
            `pooled_tables` would refuse; distinct from `pooled_tables`' and
            `pooled_by_rows`' names.
        sharding: how server-held tables' rows are held and read, pinned per parameter name:
            ``{"emb.weight": "pooled_by_rows", "*": "rows"}``. ``"rows"``: rows partitioned
            over the servers, the rows a step reads pulled to the workers and their
            gradient rows pushed back (the papers' path; never pooled); ``"pooled"``,
            ``"pooled_by_rows"``, ``"pooled_by_columns"``: as `pooled_tables`,
            `pooled_by_rows` and `pooled_by_columns` (the same pins, kept as shorthands: a
            name in both must agree). The key ``"*"`` pins every table the mapping and the
            shorthands do not name. A table no pin names is the planner's (the hybrid's
            choice after the warm-up). The pooled kinds take and refuse what those fields
            do. The plan records each table's kind (its ``sharding``).
        link_gbit: the inter-machine link's rate in Gbit/s each way (full duplex), for the
            plan's predicted link times (its bytes per machine and step at this rate;
            `parallax.planning.link`). ``None``: measured once after the warm-up by timed
            all_to_alls across machines (a few MB).
        server_threads: threads with which a server aggregates and updates its partitions in
            parallel. ``None``: this process's torch thread count.
        partition_search_steps: training steps timed per sample of the partition-count search
            of the tables created inside `parallax.partitioner` (the first half of them is
            discarded as warm-up after re-partitioning). 100: the papers' sample (100 steps,
            the first 50 dropped).
        max_partitions: the largest partition count that search tries. ``None``: 64 per
            server, and never more than the smallest searched table's rows.
        partition_cache: JSON file remembering searched partition counts per model signature
            and cluster shape, so the next run of the same job skips the search. ``None``: no
            cache. ``~`` is expanded.
        checkpoint_dir: where `Runner.save` writes sharded checkpoints (``step-<N>``
            directories; a shared file system when machines are separate hosts), and where a
            new run looks for the newest complete one to resume from. ``None``: no automatic
            checkpoints.
        checkpoint_every_steps: save every this many training steps (needs checkpoint_dir).
        checkpoint_every_secs: save when this many seconds passed since the last save
            (rank 0's clock decides, for all ranks; needs checkpoint_dir).
        checkpoint_keep: complete checkpoints kept in checkpoint_dir (older ones are deleted).
        resume: at start, load the newest complete checkpoint in checkpoint_dir if there is one
            (how a job restarted by ``parallax run --max-restarts`` goes on).
        nonfinite: what a step does when the loss on any worker or any aggregated gradient is
            NaN or infinite: ``"raise"`` (every worker raises `NonFiniteError`, a
            ``FloatingPointError``, naming the ranks and parameters, before any update),
            ``"skip"`` (every worker skips the
            update consistently and training goes on) or ``"ignore"`` (no check, no cost).
        collective_timeout_s: every collective and wait gives up after this many seconds with
            an error instead of hanging.
        find_unused_parameters: passed to DDP for models whose dense parameters are not all
            used in every step. Under ``parallelism`` ``"model"``/``"2d"`` the data groups
            agree each step on which parameters got a gradient (one small all-reduce); a
            replica whose rows did not use one reduces zeros for it. Without it, a missing
            gradient is refused, naming the parameter.
        log_dir: where rank 0 writes TensorBoard event files (loss, targets per second, bytes
            per step measured and predicted, α and partitions per table, phase times;
            `parallax.metrics`); needs the ``tensorboard`` package. ``None``: no files.
        log_every_steps: steps between two writes to ``log_dir`` (each write covers them).
    """

    architecture: str = ArchitectureName.HYBRID
    dense_sync: str = DenseSyncName.HIERARCHICAL
    sync: str = SyncName.SYNC
    max_staleness: int | None = None
    qsgd: QSGD | None = None
    slim: SlimDP = dataclasses.field(default_factory=SlimDP)
    parallelism: str = ParallelismName.DATA
    mesh: tuple[int, int] | None = None
    model_split: str = ModelSplitName.PAIRS
    local_aggregation: bool | None = None
    local_aggregation_trial_steps: int = 8
    sparsity_warmup_steps: int = 5
    alpha_threshold: float | None = None
    lazy_sparse_updates: bool = False
    overlap_push: bool = True
    average_dense: bool = True
    average_sparse: bool = True
    clip_grad_norm: float | None = None
    after_aggregation: str = PlacementName.SERVERS
    id_dedup: str = PlacementName.WORKERS
    seed: int = 0
    num_partitions: int | None = None
    pooled_tables: tuple[str, ...] | None = None
    pooled_by_rows: tuple[str, ...] = ()
    pooled_by_columns: tuple[str, ...] = ()
    sharding: Mapping[str, str] | None = None
    link_gbit: float | None = None
    server_threads: int | None = None
    partition_search_steps: int = 8
    max_partitions: int | None = None
    partition_cache: str | None = "~/.cache/parallax/partitions.json"
    checkpoint_dir: str | None = None
    checkpoint_every_steps: int | None = None
    checkpoint_every_secs: float | None = None
    checkpoint_keep: int = 2
    resume: bool = True
    nonfinite: str = "raise"
    collective_timeout_s: float = 300.0
    find_unused_parameters: bool = False
    log_dir: str | None = None
    log_every_steps: int = 10

    def __post_init__(self) -> None:
        _require(isinstance(self.architecture, str) and self.architecture in ARCHITECTURES,
                 "architecture", self.architecture, f"one of {ARCHITECTURES}")
        object.__setattr__(self, "architecture", ArchitectureName(self.architecture))
        _require(isinstance(self.dense_sync, str) and self.dense_sync in DENSE_SYNCS,
                 "dense_sync", self.dense_sync, f"one of {DENSE_SYNCS}")
        object.__setattr__(self, "dense_sync", DenseSyncName(self.dense_sync))
        self._check_dense_sync()
        self._check_parallelism()
        self._check_sync()
        if self.local_aggregation is not None:
            _require(isinstance(self.local_aggregation, bool), "local_aggregation",
                     self.local_aggregation, "None or a bool")
            _require(not (self.local_aggregation and self.architecture == "allreduce"),
                     "local_aggregation", self.local_aggregation,
                     "None or False with architecture='allreduce' (it has no servers)")
        for name in ("average_dense", "average_sparse", "find_unused_parameters",
                     "lazy_sparse_updates", "overlap_push"):
            _require(isinstance(getattr(self, name), bool), name, getattr(self, name), "a bool")
        if self.clip_grad_norm is not None:
            value = self.clip_grad_norm
            ok = is_number(value) and math.isfinite(value) and value > 0
            _require(ok, "clip_grad_norm", value, "None or a finite number > 0")
        self._check_placements()
        _require(is_int(self.seed) and -(2**63) <= self.seed < 2**64, "seed", self.seed,
                 "an int in [-2**63, 2**64) (what torch.manual_seed takes)")
        self._check_planning()
        self._check_checkpoints()
        self._check_reporting()
        self._check_failures()

    def _check_placements(self) -> None:
        """Seed 001's operation placements (`after_aggregation`, `id_dedup`)."""
        for name, default in (("after_aggregation", PlacementName.SERVERS),
                              ("id_dedup", PlacementName.WORKERS)):
            value = getattr(self, name)
            _require(isinstance(value, str) and value in PLACEMENTS, name, value,
                     f"one of {PLACEMENTS}")
            object.__setattr__(self, name, PlacementName(value))
            _require(value == default or self.sync == SyncName.SYNC, name, value,
                     f"{str(default)!r} with sync={str(self.sync)!r} (the placement without "
                     f"it is a baseline of synchronous training's aggregation)")

    def _check_planning(self) -> None:
        """The warm-up, α threshold, partition and server-thread options."""
        steps = self.sparsity_warmup_steps
        _require(is_int(steps) and steps >= 0, "sparsity_warmup_steps", steps, "an int >= 0")
        if self.alpha_threshold is not None:
            value = self.alpha_threshold
            _require(is_number(value) and 0 <= value <= 1, "alpha_threshold", value,
                     "None or a number in [0, 1]")
        self._check_pooled_tables()
        self._check_sharding()
        if self.num_partitions is not None:
            ok = is_int(self.num_partitions) and self.num_partitions >= 1
            _require(ok, "num_partitions", self.num_partitions, "None or an int >= 1")
        for name in ("server_threads", "max_partitions"):
            value = getattr(self, name)
            if value is not None:
                _require(is_int(value) and value >= 1, name, value, "None or an int >= 1")
        if self.link_gbit is not None:
            value = self.link_gbit
            ok = is_number(value) and math.isfinite(value) and value > 0
            _require(ok, "link_gbit", value, "None or a finite number > 0 (Gbit/s each way)")
        trial = self.local_aggregation_trial_steps
        _require(is_int(trial) and (trial == 0 or trial >= 2), "local_aggregation_trial_steps",
                 trial, "0 or an int >= 2 (the first half of each sample's steps is discarded)")
        steps = self.partition_search_steps
        _require(is_int(steps) and steps >= 2, "partition_search_steps", steps,
                 "an int >= 2 (the first half of each sample's steps is discarded)")
        if isinstance(self.partition_cache, os.PathLike):
            object.__setattr__(self, "partition_cache", os.fspath(self.partition_cache))
        if self.partition_cache is not None:
            _require(isinstance(self.partition_cache, str) and self.partition_cache != "",
                     "partition_cache", self.partition_cache, "None or a file path")

    def _check_pooled_tables(self) -> None:
        names = self.pooled_tables
        ok = names is None or (isinstance(names, (tuple, list))
                               and all(isinstance(n, str) for n in names)
                               and len(set(names)) == len(names))
        _require(ok, "pooled_tables", names, "a tuple of distinct parameter names")
        self._check_pooling_setup("pooled_tables", names)
        if names is not None:
            object.__setattr__(self, "pooled_tables", tuple(names))
        rows = self.pooled_by_rows
        ok = (isinstance(rows, (tuple, list)) and all(isinstance(n, str) for n in rows)
              and len(set(rows)) == len(rows) and not set(rows) & set(names or ()))
        _require(ok, "pooled_by_rows", rows, "a tuple of distinct parameter names, none of "
                 "them in pooled_tables")
        self._check_pooling_setup("pooled_by_rows", rows)
        object.__setattr__(self, "pooled_by_rows", tuple(rows))
        columns = self.pooled_by_columns
        ok = (isinstance(columns, (tuple, list)) and all(isinstance(n, str) for n in columns)
              and len(set(columns)) == len(columns)
              and not set(columns) & (set(names or ()) | set(rows)))
        _require(ok, "pooled_by_columns", columns, "a tuple of distinct parameter names, "
                 "none of them in pooled_tables or pooled_by_rows")
        self._check_pooling_setup("pooled_by_columns", columns)
        object.__setattr__(self, "pooled_by_columns", tuple(columns))

    def _check_sharding(self) -> None:
        mapping = self.sharding
        if mapping is None:
            return
        kinds = tuple(map(str, ShardingName))
        ok = isinstance(mapping, Mapping) and all(
            isinstance(k, str) and k and isinstance(v, str) and v in kinds
            for k, v in mapping.items())
        _require(ok, "sharding", mapping, f"None or a mapping of parameter names (or "
                 f"{EVERY_OTHER_TABLE!r}: every other table) to one of {kinds}")
        pinned = Pins(mapping)
        for name, kind in pinned.items():
            other = self._shorthand_pin(name)
            if other is not None:
                _require(other[0] == kind, "sharding", mapping, f"a mapping that agrees with "
                         f"Config.{other[1]} ({name!r} is {other[0]} there)")
        self._check_pooling_setup("sharding", {
            k: v for k, v in pinned.items() if v != ShardingName.ROWS})
        object.__setattr__(self, "sharding", pinned)

    def _shorthand_pin(self, name: str) -> tuple[ShardingName, str] | None:
        """The kind the shorthand fields (`pooled_tables`, `pooled_by_rows`,
        `pooled_by_columns`) pin ``name`` to by naming it, with the field."""
        if self.pooled_tables is not None and name in self.pooled_tables:
            return ShardingName.POOLED, "pooled_tables"
        if name in self.pooled_by_rows:
            return ShardingName.POOLED_BY_ROWS, "pooled_by_rows"
        if name in self.pooled_by_columns:
            return ShardingName.POOLED_BY_COLUMNS, "pooled_by_columns"
        return None

    def pinned_sharding(self, name: str) -> tuple[ShardingName, str] | None:
        """The sharding kind the program pins table ``name`` to, with the `Config` field that
        pins it (for messages); None: the planner's choice. `sharding` naming it first, then
        the shorthand fields, then `sharding`'s ``"*"``; a `pooled_tables` given (even
        ``()``) keeps every table it does not name on the row path."""
        mapping = self.sharding or {}
        if name in mapping:
            return ShardingName(mapping[name]), f"sharding[{name!r}]"
        shorthand = self._shorthand_pin(name)
        if shorthand is not None:
            return shorthand
        if EVERY_OTHER_TABLE in mapping:
            return ShardingName(mapping[EVERY_OTHER_TABLE]), f"sharding[{EVERY_OTHER_TABLE!r}]"
        if self.pooled_tables is not None:
            return ShardingName.ROWS, "pooled_tables"
        return None

    def named_pins(self) -> dict[str, tuple[ShardingName, str]]:
        """Every table the program names to pin it (`pinned_sharding` of each), in name
        order: each must be one of the model's tables."""
        names = {*(self.sharding or {}), *(self.pooled_tables or ()), *self.pooled_by_rows,
                 *self.pooled_by_columns} - {EVERY_OTHER_TABLE}
        return {name: pin for name in sorted(names)
                if (pin := self.pinned_sharding(name)) is not None}

    def _check_pooling_setup(self, field: str, names: Any) -> None:
        """Tables named in ``field`` are pooled by servers, in the synchronous step."""
        if names:
            _require(self.architecture != ArchitectureName.ALLREDUCE, field, names,
                     "() with architecture='allreduce' (no server holds a table to pool on)")
            _require(self.sync == SyncName.SYNC, field, names,
                     f"() with sync={str(self.sync)!r} (bags are pooled in the step of the "
                     f"synchronous exchange)")

    def _check_checkpoints(self) -> None:
        """Where checkpoints go, how often, how many are kept, and resuming."""
        if isinstance(self.checkpoint_dir, os.PathLike):
            object.__setattr__(self, "checkpoint_dir", os.fspath(self.checkpoint_dir))
        if self.checkpoint_dir is not None:
            _require(isinstance(self.checkpoint_dir, str) and self.checkpoint_dir != "",
                     "checkpoint_dir", self.checkpoint_dir, "None or a directory path")
        every = self.checkpoint_every_steps
        if every is not None:
            _require(is_int(every) and every >= 1, "checkpoint_every_steps", every,
                     "None or an int >= 1")
        secs = self.checkpoint_every_secs
        if secs is not None:
            _require(is_number(secs) and math.isfinite(secs) and secs > 0,
                     "checkpoint_every_secs", secs, "None or a finite number of seconds > 0")
        if self.checkpoint_dir is None:
            for name in ("checkpoint_every_steps", "checkpoint_every_secs"):
                _require(getattr(self, name) is None, name, getattr(self, name),
                         "None unless Config.checkpoint_dir says where checkpoints go")
        _require(is_int(self.checkpoint_keep) and self.checkpoint_keep >= 1,
                 "checkpoint_keep", self.checkpoint_keep, "an int >= 1")
        _require(isinstance(self.resume, bool), "resume", self.resume, "a bool")

    def _check_reporting(self) -> None:
        """TensorBoard's folder and its cadence."""
        if isinstance(self.log_dir, os.PathLike):
            object.__setattr__(self, "log_dir", os.fspath(self.log_dir))
        if self.log_dir is not None:
            _require(isinstance(self.log_dir, str) and self.log_dir != "", "log_dir",
                     self.log_dir, "None or a directory path")
            if importlib.util.find_spec("tensorboard") is None:
                raise ConfigError(
                    "Config.log_dir writes TensorBoard event files, which needs the "
                    "tensorboard package: pip install tensorboard (or pip install "
                    "'parallax-torch[metrics]')")
        every = self.log_every_steps
        _require(is_int(every) and every >= 1, "log_every_steps", every, "an int >= 1")

    def _check_failures(self) -> None:
        """What a NaN step does, and how long a collective may wait."""
        _require(self.nonfinite in NONFINITE, "nonfinite", self.nonfinite,
                 f"one of {NONFINITE}")
        timeout = self.collective_timeout_s
        ok = (is_number(timeout) and math.isfinite(timeout)
              and 0 < timeout < timedelta.max.total_seconds())
        _require(ok, "collective_timeout_s", timeout,
                 "a number of seconds > 0 and below timedelta.max")

    def _check_dense_sync(self) -> None:
        """The dense-sync options: dicts (from `to_dict`/JSON) become their classes."""
        for name, kind in (("qsgd", QSGD), ("slim", SlimDP)):
            value = getattr(self, name)
            if isinstance(value, dict):
                fields = {f.name for f in dataclasses.fields(kind)}
                _require(set(value) <= fields, name, value,
                         f"a parallax.{kind.__name__} or a dict of its fields {sorted(fields)}")
                object.__setattr__(self, name, kind(**value))
        _require(self.qsgd is None or isinstance(self.qsgd, QSGD), "qsgd", self.qsgd,
                 "None or a parallax.QSGD")
        _require(isinstance(self.slim, SlimDP), "slim", self.slim, "a parallax.SlimDP")
        if self.dense_sync == DenseSyncName.QSGD and self.qsgd is None:
            object.__setattr__(self, "qsgd", QSGD())
        _require(self.qsgd is None or self.dense_sync in (DenseSyncName.QSGD, *SERVER_SYNCS),
                 "qsgd", self.qsgd, "None unless dense_sync is 'qsgd', 'plump' or 'slim'")
        if self.dense_sync in (DenseSyncName.HIERARCHICAL, DenseSyncName.FLAT):
            return
        _require(self.architecture in (ArchitectureName.HYBRID, ArchitectureName.ALLREDUCE),
                 "dense_sync", str(self.dense_sync),
                 f"'hierarchical' or 'flat' with architecture={str(self.architecture)!r} "
                 f"(its dense parameters live on the parameter servers)")
        if self.dense_sync in SERVER_SYNCS:
            # the workers' gradients differ (each updates its own copy): a global norm of
            # aggregated gradients does not exist, and the servers' dense model is assembled
            # from every rank, which the sharded checkpoint format does not hold yet
            _require(self.clip_grad_norm is None, "clip_grad_norm", self.clip_grad_norm,
                     f"None with dense_sync={str(self.dense_sync)!r} (each worker updates "
                     f"its own copy from its own gradients: there is no aggregated gradient "
                     f"to clip)")
            _require(self.checkpoint_dir is None, "checkpoint_dir", self.checkpoint_dir,
                     f"None with dense_sync={str(self.dense_sync)!r}: checkpoints of the "
                     f"servers' dense model and the workers' pending updates are not "
                     f"implemented yet (export the model with Runner.export)")

    def _check_sync(self) -> None:
        _require(isinstance(self.sync, str) and self.sync in SYNCS, "sync", self.sync,
                 f"one of {SYNCS}")
        object.__setattr__(self, "sync", SyncName(self.sync))
        if self.sync == SyncName.SYNC:
            _require(self.max_staleness is None, "max_staleness", self.max_staleness,
                     "None with sync='sync' (a staleness bound is for 'async'/'async-sparse')")
            return
        mode = repr(str(self.sync))
        if self.max_staleness is not None:
            _require(is_int(self.max_staleness) and self.max_staleness >= 0, "max_staleness",
                     self.max_staleness, "None or an int >= 0")
        wanted = (ArchitectureName.PS if self.sync == SyncName.ASYNC
                  else ArchitectureName.HYBRID)
        _require(self.architecture == wanted, "architecture", str(self.architecture),
                 f"{str(wanted)!r} with sync={mode} (" + (
                     "asynchronous parameter servers hold the dense parameters too"
                     if wanted == ArchitectureName.PS else
                     "dense parameters AllReduced, sparse rows on asynchronous servers") + ")")
        _require(not self.local_aggregation, "local_aggregation", self.local_aggregation,
                 f"None or False with sync={mode} (each worker pulls and pushes on its own "
                 f"clock: there is no step in which a machine's workers could merge rows)")
        _require(self.parallelism == ParallelismName.DATA, "parallelism",
                 str(self.parallelism), f"'data' with sync={mode}")
        _require(self.dense_sync not in SERVER_SYNCS, "dense_sync", str(self.dense_sync),
                 f"'hierarchical', 'flat' or 'qsgd' with sync={mode}")
        _require(self.checkpoint_every_secs is None, "checkpoint_every_secs",
                 self.checkpoint_every_secs,
                 f"None with sync={mode} (rank 0's clock would have to reach every worker "
                 f"each step: use checkpoint_every_steps)")
        if self.sync == SyncName.ASYNC_SPARSE:
            _require(self.clip_grad_norm is None, "clip_grad_norm", self.clip_grad_norm,
                     "None with sync='async-sparse' (the dense gradient is aggregated, the "
                     "sparse rows are each worker's own: no norm exists that every worker "
                     "agrees on without a barrier); sync='async' clips each push")

    def _check_parallelism(self) -> None:
        _require(isinstance(self.parallelism, str) and self.parallelism in PARALLELISMS,
                 "parallelism", self.parallelism, f"one of {PARALLELISMS}")
        object.__setattr__(self, "parallelism", ParallelismName(self.parallelism))
        given = self.mesh  # (messages name the value as given: a list, from JSON)
        if self.parallelism == ParallelismName.TWO_D:
            _require(given is not None, "parallelism", str(self.parallelism),
                     "'data', 'model' or 'auto' unless Config.mesh names the (data, model) grid")
            ok = (isinstance(given, (tuple, list)) and len(given) == 2
                  and all(is_int(d) and d >= 1 for d in given))
            _require(ok, "mesh", given,
                     "a (data, model) pair of ints >= 1 with parallelism='2d'")
            object.__setattr__(self, "mesh", tuple(given or ()))
        else:
            _require(given is None, "mesh", given,
                     f"None with parallelism={str(self.parallelism)!r} (a grid is named "
                     f"with parallelism='2d')")
        splits = tuple(m.value for m in ModelSplitName)
        _require(isinstance(self.model_split, str) and self.model_split in splits,
                 "model_split", self.model_split, f"one of {splits}")
        object.__setattr__(self, "model_split", ModelSplitName(self.model_split))
        if self.parallelism == ParallelismName.DATA:
            _require(self.model_split == ModelSplitName.PAIRS, "model_split",
                     str(self.model_split), "'pairs' with parallelism='data' (no layer is "
                     "split; name parallelism 'model', '2d' or 'auto')")
            return
        _require(self.architecture == ArchitectureName.HYBRID, "architecture",
                 str(self.architecture),
                 f"'hybrid' with parallelism={str(self.parallelism)!r} (the split layers' "
                 f"gradients are reduced over the data groups beside the hybrid's servers)")
        _require(self.dense_sync in (DenseSyncName.HIERARCHICAL, DenseSyncName.FLAT),
                 "dense_sync", str(self.dense_sync),
                 f"'hierarchical' or 'flat' with parallelism={str(self.parallelism)!r} (its "
                 f"data groups all-reduce the dense gradients themselves)")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Config:
        """Build from a mapping (e.g. parsed JSON/YAML), naming any unknown field."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known, key=repr)  # keys of any type (YAML's yes: True)
        if unknown:
            raise ConfigError(
                f"unknown Config field(s) {unknown}; valid fields are {sorted(known)}"
            )
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """Plain values (enums as their strings), for JSON and comparisons across ranks."""
        return {k: (str(v) if isinstance(v, StrEnum) else
                    {name: str(kind) for name, kind in v.items()} if isinstance(v, Pins) else v)
                for k, v in dataclasses.asdict(self).items()}


def _require(ok: bool, name: str, value: object, expected: str) -> None:
    if not ok:
        raise ConfigError(f"Config.{name} must be {expected}, got {value!r}")
