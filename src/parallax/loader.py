"""`shard`: this worker's disjoint part of a data loader, resumable at any sample position.

Worker r of W takes samples r, r+W, r+2W, ... so the k-th batches of all workers together are
the single-device program's k-th batch of size W*b; checkpoints save and restore positions in
the epoch's *global* order (`records`), so a resume may change W.

``for batch in parallax.shard(loader):`` inside an epoch loop is the README's port: `shard` of
the same ``DataLoader`` object returns the same `ShardedLoader` (kept on the DataLoader), so
its epochs go on (a new shuffle each) and a checkpoint finds it; an iteration keeps its
loader alive, so even a loader built inline is found.

A loader belongs to one training run (`parallax.runs`): the run current when it starts an
iteration. A checkpoint saves the positions of its run's loaders only, each with what the
loader reads (`describe`); a resume gives them to the loaders of the resuming run in order
(those made before it, then those made after: `resume_later`), and refuses a loader that reads
other data than the one whose position it would take.
"""

from __future__ import annotations

import gc
import itertools
import math
from collections.abc import Iterable, Iterator, Sized
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    default_collate,
)

from parallax import runs
from parallax.checks import is_int
from parallax.cluster import WorkerInfo, current_worker
from parallax.errors import (
    ArgumentError,
    ArgumentTypeError,
    CheckpointError,
    UnsupportedProgramError,
)
from parallax.logs import log
from parallax.runs import TrainingRun
from parallax.verify import record as verify

__all__ = ["ShardedLoader", "check_resumed", "describe", "reachable_loaders", "records",
           "resume_later", "resume_loaders", "run_loaders", "shard", "unbound_loaders"]

_ATTRIBUTE = "_parallax_sharded"  # a DataLoader's ShardedLoader, made by `shard`


class _SkipSampler(Sampler[int]):
    """A ``DistributedSampler`` minus the first ``skip`` indices of its list.

    Resuming mid-epoch skips indices rather than loading and discarding samples, so a resume
    costs nothing however far into the epoch it lands.
    """

    def __init__(self, inner: DistributedSampler[Any]) -> None:
        self.inner = inner
        self.skip = 0

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(iter(self.inner), self.skip, None)

    def __len__(self) -> int:
        return max(0, len(self.inner) - self.skip)


@dataclass
class _EpochState:
    """One iteration's progress, owned by its generator so a stale iterator cannot skew it."""

    epoch: int
    skipped: int  # global samples skipped at the start (a resumed epoch), else 0
    batches: int  # batches this iteration will yield
    yielded: int = 0


def run_loaders(run: TrainingRun | None = None) -> list[ShardedLoader]:
    """The live ShardedLoaders of ``run`` (the current run by default) in the order they
    joined it: what its checkpoints save (weak references: a dropped loader is not kept)."""
    run = run if run is not None else runs.current_run()
    held = run.loaders() if run is not None else []
    return [loader for loader in held if isinstance(loader, ShardedLoader)]


def unbound_loaders() -> list[ShardedLoader]:
    """Live loaders no run holds yet (made before ``distribute``), in the order made."""
    return [loader for loader in runs.unbound_loaders() if isinstance(loader, ShardedLoader)]


class ShardedLoader:
    """This worker's disjoint part of a ``DataLoader``.

    Worker r of W takes samples r, r+W, r+2W, ... (``DistributedSampler``), so its k-th batch
    of b samples and the other workers' k-th batches together are exactly samples
    ``[k*W*b, (k+1)*W*b)``: the single-device program's k-th batch with batch size ``W*b``.
    The order is the original loader's: in order (``SequentialSampler``), a new seeded
    shuffle each iteration (``RandomSampler``; the global generator advances by the one draw
    torch's sampler takes), or, for a DDP program's ``DistributedSampler``, its shuffle, seed
    and padding, in the epoch the program set with ``sampler.set_epoch`` (the same order
    every iteration if it never does, as under DDP). Other samplers are refused.

    `position` and `resume` let a checkpoint continue the data stream where it stopped, also
    on a different number of workers: positions count samples of the epoch's *global* order,
    which does not depend on W.

    Under model or 2-D parallelism (`Config.parallelism`) the ``m`` workers of a model group
    share one data replica: each reads the ``m * b`` samples the group would read under data
    parallelism (`set_data_parallel`), so the global batch stays ``W * b``.
    """

    def __init__(self, original: DataLoader[Any], seed: int, worker: WorkerInfo):
        self.original = original
        self.seed = seed
        self.worker = worker
        self.epoch = 0
        self._state: _EpochState | None = None
        self._resume_at: dict[str, int] | None = None
        # parallax verify's one-process reference run reads the distributed run's global
        # batch (its W times the loader's), in the same order.
        verification = verify.active()
        self._reference_factor = (verification.workers if verification is not None
                                  and verification.role == "reference" else 1)
        if self._reference_factor > 1:
            _note_padding(original, self._reference_factor)
        #: the training run this loader belongs to (`parallax.runs`); None until one takes it
        self.run: TrainingRun | None = None
        run = runs.current_run()
        # the current run's grid from the start (len() under model parallelism); the next
        # run regrids the loaders no run holds yet when it builds its own
        self.regrid(*((run.data_parallel if run is not None else None)
                      or (worker.world_size, worker.rank, 1)))
        if run is not None and run.waiting:  # a resume before this loader existed
            self._join(run)
            self._take(run.waiting.pop(0), run)
        else:
            runs.hold_unbound(self)

    def _join(self, run: TrainingRun) -> None:
        """Belong to ``run`` and read as its grid says; rank 0 says once per run how this
        loader's batches differ from the single-device program's, if they do."""
        runs.bind(self, run)
        for key, note in _differences(self.original, self.seed):
            if self.worker.rank == 0 and key not in run.said:
                log.warning("%s", note)
            run.said.add(key)
        grid = run.data_parallel or (self.worker.world_size, self.worker.rank, 1)
        if self.grid != grid:
            self.regrid(*grid)

    def _take(self, record: dict[str, Any], run: TrainingRun) -> None:
        """Resume at a checkpoint's ``record`` of a loader, refusing one that read other
        data (it would silently continue another stream)."""
        saved, mine = record.get("loader"), describe(self)
        if saved is not None and saved != mine:
            theirs = [describe(loader) for loader in run_loaders(run)]
            raise CheckpointError(
                f"rank {self.worker.rank}: the checkpoint resumed by run {run.number} of this "
                f"process holds the position of a parallax.shard loader reading {saved}, and "
                f"the next loader of this run reads {mine}: it would continue another loader's "
                f"data. The checkpoint's loaders, in order: {record.get('all', [saved])}; this "
                f"run's: {theirs}. Make the same loaders, in the same order, as the program "
                f"that saved it")
        self.resume(record["position"])
        run.taken += 1

    def regrid(self, replicas: int, index: int, group_size: int) -> None:
        """Read as data replica ``index`` of ``replicas``, ``group_size`` times the original
        batch per step (the workers of a model group read the same samples)."""
        original = self.original
        self.grid = (replicas, index, group_size)
        self.replicas = replicas
        batching = _batching(original)
        assert batching is not None  # shard checked it
        order = batching.sampler
        # A DDP program's own DistributedSampler: its shuffle, seed and padding, and its
        # epoch (set_epoch) at each iteration, as the program would have used them.
        if isinstance(order, DistributedSampler):
            shuffle, seed, drop_last = order.shuffle, order.seed, order.drop_last
        else:
            shuffle = isinstance(order, RandomSampler)
            seed, drop_last = self.seed, batching.drop_last
        self.sampler: DistributedSampler[Any] = DistributedSampler(
            original.dataset, num_replicas=replicas, rank=index, shuffle=shuffle, seed=seed,
            drop_last=drop_last)
        skipper = _SkipSampler(self.sampler)
        #: this worker's batch size
        self.batch_size = batching.batch_size * group_size * self._reference_factor
        self.loader = DataLoader(
            original.dataset,
            batch_size=self.batch_size,
            sampler=skipper, num_workers=original.num_workers,
            collate_fn=original.collate_fn, pin_memory=original.pin_memory,
            drop_last=batching.drop_last, timeout=original.timeout,
            worker_init_fn=original.worker_init_fn,
            persistent_workers=original.persistent_workers if original.num_workers else False,
        )
        self._skipper: _SkipSampler | None = skipper
        self._order = order  # the program's sampler

    @property
    def global_batch(self) -> int:
        """Samples all workers together take per step: ``W * b``."""
        return self.replicas * self.batch_size

    def __iter__(self) -> Iterator[Any]:
        run = runs.current_run()
        if run is not None and self.run is not run:
            self._join(run)
        epoch, skipped = self.epoch, 0
        if self._resume_at is not None:
            epoch, skipped = self._resume_at["epoch"], self._resume_at["samples"]
            self._resume_at = None
        elif isinstance(self._order, DistributedSampler):
            epoch = self._order.epoch  # the program's set_epoch, as under DDP
        if _draws_a_seed(self._order):
            # RandomSampler draws its seed from torch's global generator at each iteration:
            # the same draw here keeps the program's random stream (dropout, ...) in step
            # with the single-device program's, though the order is a seeded permutation.
            torch.empty((), dtype=torch.int64).random_()
        if self._skipper is not None:
            # Only the resumed epoch is shortened: every other iteration resets the skip.
            self._skipper.skip = skipped // self.replicas
        self.sampler.set_epoch(epoch)
        self.epoch = epoch + 1
        self._state = _EpochState(epoch, skipped, len(self.loader))
        return self._count(iter(self.loader), self._state)

    def _count(self, batches: Iterator[Any], state: _EpochState) -> Iterator[Any]:
        """Yield ``batches``, counting each before it is handed out: a checkpoint taken while
        the program works on a batch counts that batch as consumed. (A method: the iteration
        holds this loader, so that a checkpoint finds one built inline,
        ``for batch in parallax.shard(DataLoader(...))``.)"""
        for batch in batches:
            state.yielded += 1
            yield batch

    def __len__(self) -> int:
        """Batches in a *full* epoch, as for the original loader (so schedules computed as
        ``len(loader) * epochs`` stay right). A resumed epoch yields fewer: it starts
        ``position()["samples"] // global_batch`` batches in (when resumed at a multiple of
        the global batch)."""
        per_worker = len(self.sampler)
        if self.loader.drop_last:
            return per_worker // self.batch_size
        return math.ceil(per_worker / self.batch_size)

    def position(self) -> dict[str, int]:
        """Where the data stream stands: ``{"epoch": e, "samples": s}``.

        ``s`` samples of epoch ``e``'s global order are consumed by all workers together
        (batches yielded * W * b, since workers step in lock step). Once an epoch's last batch
        has been handed out the position is the next epoch with 0 samples, so a final partial
        batch or ``DistributedSampler`` padding never appears in a position. Before the first
        iteration (or after `resume`, before iterating) it is where the next iteration starts.
        """
        if self._resume_at is not None:
            return dict(self._resume_at)
        state = self._state
        if state is None or state.yielded >= state.batches:
            return {"epoch": self.epoch, "samples": 0}
        return {"epoch": state.epoch,
                "samples": state.skipped + state.yielded * self.global_batch}

    def resume(self, position: dict[str, int]) -> None:
        """Make the next iteration start epoch ``position["epoch"]`` after its first
        ``position["samples"]`` samples of the global order.

        Every worker skips ``samples / W`` indices of its own list: padding (``drop_last``
        False) and trimming (``drop_last`` True) of ``DistributedSampler`` touch only the end
        of the epoch's order, so the rest of the epoch is the uninterrupted program's stream
        from that sample on, whatever W was when the position was taken; when the new global
        batch ``W * b`` divides ``samples`` the batches are exactly that program's (with
        ``drop_last`` False its last batch carries the usual < W padding duplicates). Only
        this epoch is shortened; later ones are whole. ``seed`` and shuffling must match.
        """
        epoch, samples = _checked_position(position)
        world = self.replicas
        if samples % world:
            raise ArgumentError(
                f"cannot resume at samples={samples} on {world} workers: every worker must skip "
                f"the same number of samples, so {samples} must be a multiple of {world}; "
                f"choose a new global batch (workers x batch size) that divides the "
                f"{samples} samples consumed")
        if samples and self._skipper is None:
            raise ArgumentError(f"cannot resume at samples={samples}: this ShardedLoader's "
                             "DataLoader was not built by parallax.shard, so it cannot skip")
        size = _dataset_size(self.sampler.dataset)
        if samples > size:
            raise ArgumentError(f"cannot resume at samples={samples}: the dataset has only "
                             f"{size} samples per epoch")
        self._resume_at = {"epoch": epoch, "samples": samples}


@dataclass(frozen=True)
class _Batching:
    """How a loader batches: its sample order, batch size and drop_last, read from the
    loader's ``batch_size`` arguments or from a plain ``BatchSampler`` it was given (the same
    batches: ``DataLoader(batch_sampler=BatchSampler(s, b, d))`` is
    ``DataLoader(sampler=s, batch_size=b, drop_last=d)``)."""

    sampler: Any
    batch_size: int
    drop_last: bool


def _batching(loader: DataLoader[Any]) -> _Batching | None:
    """``loader``'s `_Batching`; None for a batch sampler other than torch's plain one."""
    if loader.batch_size is not None:
        return _Batching(loader.sampler, loader.batch_size, loader.drop_last)
    batches = loader.batch_sampler
    if type(batches) is BatchSampler:  # not a subclass: its batches may be anything
        return _Batching(batches.sampler, batches.batch_size, batches.drop_last)
    return None


def _differences(original: DataLoader[Any], seed: int) -> list[tuple[str, str]]:
    """How the batches `shard` makes of ``original`` differ from the single-device program's,
    with the exact alternative: (key, note) pairs."""
    batching = _batching(original)
    assert batching is not None  # shard checked it
    notes = []
    if isinstance(batching.sampler, RandomSampler):
        notes.append(("shuffled", (
            f"parallax.shard: a DataLoader with shuffle=True (RandomSampler): each epoch's "
            f"order is a permutation seeded by shard(seed={seed}) and the epoch, as "
            f"DistributedSampler's, not torch's draw from the global generator, so its batches "
            f"are not the single-device program's. For the same batches on one device and on "
            f"any number of workers, give the DataLoader sampler=DistributedSampler(dataset, "
            f"num_replicas=1, rank=0, shuffle=True, seed=S) and call sampler.set_epoch(epoch) "
            f"each epoch: parallax.shard keeps that order")))
    if batching.batch_size == 1 and original.collate_fn is not default_collate:
        notes.append(("batch-as-item", (
            "parallax.shard: a DataLoader of batch_size=1 with its own collate_fn: if each "
            "item is a whole mini-batch (as DLRM's dataset makes them), shard deals whole "
            "items to the workers, so one step trains W of them where the single-device "
            "program's trains one. Make the dataset yield samples and the DataLoader batch "
            "them (batch_size=b), or give each worker its share of every item in the program, "
            "as for DDP, without parallax.shard")))
    return notes


def _note_padding(original: DataLoader[Any], workers: int) -> None:
    """For parallax verify's report: an epoch that ``DistributedSampler`` pads on
    ``workers`` workers ends with another last batch than the one-process run's."""
    batching = _batching(original)
    assert batching is not None  # shard checked it
    order = batching.sampler
    drop_last = order.drop_last if isinstance(order, DistributedSampler) else batching.drop_last
    size = len(original.dataset)  # type: ignore[arg-type]
    if size % workers and not drop_last:
        verify.add_hint(
            f"a sharded loader's dataset has {size} samples, not a multiple of the {workers} "
            f"workers: DistributedSampler pads each epoch's last batch with "
            f"{-size % workers} repeated sample(s), as under DDP, so that step differs from "
            f"one device's; DataLoader(drop_last=True) or a multiple of {workers} samples "
            f"trains exactly")


def _checked_position(position: dict[str, int]) -> tuple[int, int]:
    """Epoch and samples of a position, rejecting what `ShardedLoader.position` never makes."""
    if not isinstance(position, dict) or set(position) != {"epoch", "samples"}:
        raise ArgumentError("a loader position is a dict with keys 'epoch' and 'samples', "
                         f"got {position!r}")
    values = []
    for key in ("epoch", "samples"):
        value = position[key]
        if not is_int(value, at_least=0):
            raise ArgumentError(f"position[{key!r}] must be a non-negative int, got {value!r}")
        values.append(value)
    return values[0], values[1]


def shard(loader: DataLoader[Any], *, seed: int = 0) -> DataLoader[Any] | ShardedLoader:
    """This worker's part of ``loader``; the loader itself outside a parallax launch."""
    worker = current_worker()
    if worker is None:
        return loader
    if isinstance(loader.dataset, IterableDataset):
        raise ArgumentTypeError(
            "parallax.shard needs a map-style dataset (with __len__ and __getitem__); got an "
            "IterableDataset, which cannot be split by index. Split the stream yourself, as "
            "for DDP (each worker its part of every global batch, e.g. its samples "
            "rank::world_size), and iterate that loader without parallax.shard")
    batching = _batching(loader)
    if batching is None:
        raise ArgumentTypeError(
            f"parallax.shard cannot split the batches of a {type(loader.batch_sampler).__name__}"
            f" (a custom batch_sampler, e.g. bucketing by length): split them in the program, "
            f"as for DDP (each worker its part of every global batch), and iterate that loader "
            f"without parallax.shard; torch's plain BatchSampler and batch_size are split")
    _check_splittable(batching.sampler)
    made = loader.__dict__.get(_ATTRIBUTE)
    if isinstance(made, ShardedLoader) and made.seed == seed and made.worker == worker:
        return made  # the same loader again (an epoch loop): its epochs and position go on
    sharded = ShardedLoader(loader, seed, worker)
    loader.__dict__[_ATTRIBUTE] = sharded  # lives as long as the program's DataLoader
    return sharded


def reachable_loaders() -> list[ShardedLoader]:
    """The loaders the current run holds, then the ones no run holds yet (a program with
    no runner, such as parallax verify's one-process reference, has only these)."""
    return run_loaders() + unbound_loaders()


def describe(loader: ShardedLoader) -> dict[str, Any]:
    """What ``loader`` reads, as a checkpoint names it: the dataset's class and length and
    the sampler's kind (the same on any number of workers)."""
    dataset = loader.original.dataset
    order = loader._order
    kind = ("distributed" if isinstance(order, DistributedSampler)
            else "shuffled" if isinstance(order, RandomSampler) else "sequential")
    return {"dataset": type(dataset).__qualname__, "samples": _dataset_size(dataset),
            "order": kind}


def records(run: TrainingRun | None = None) -> list[dict[str, Any]]:
    """``run``'s loaders as a checkpoint saves them: each one's position and `describe`."""
    gc.collect()  # a loader the program dropped lives on in its cycle with its DataLoader
    return [{"position": loader.position(), "loader": describe(loader)}
            for loader in run_loaders(run)]


def resume_loaders(run: TrainingRun, saved: list[dict[str, Any]]) -> list[ShardedLoader]:
    """A checkpoint's loader ``saved`` records to ``run``'s loaders: first those it has, then
    the live ones no run holds yet (made before ``distribute``), in order; the rest wait for
    the loaders the program makes next (`resume_later`). Returns the loaders resumed."""
    gc.collect()  # a dropped loader (in a cycle with its DataLoader) takes no position
    candidates = run_loaders(run) + unbound_loaders()
    everything = [record.get("loader") for record in saved]
    run.resumed, run.taken = list(saved), 0
    resumed = []
    for loader, record in zip(candidates, saved, strict=False):
        loader._join(run)
        loader._take({**record, "all": everything}, run)
        resumed.append(loader)
    resume_later(run, [{**record, "all": everything} for record in saved[len(resumed):]])
    return resumed


def check_resumed(run: TrainingRun, rank: int) -> None:
    """At ``run``'s first step: a checkpoint that held loader positions, none of which a
    loader of the run took, is refused (the program's data would start over while its model
    goes on: no parallax.shard loader, or none made before the step). Positions a later
    loader takes (an evaluation loader made after the first step) may still wait."""
    if run.resumed and not run.taken:
        raise CheckpointError(
            f"rank {rank}: the checkpoint resumed by run {run.number} of this process holds "
            f"the position(s) of {len(run.resumed)} parallax.shard loader(s) "
            f"({[record.get('loader') for record in run.resumed]}), and this run's first step "
            f"came with no loader taking one (its loaders: "
            f"{[describe(loader) for loader in run_loaders(run)]}): its data would start "
            f"over while the model goes on. Make the program's loaders with parallax.shard, "
            f"as the program that saved it did, before the first step")


def resume_later(run: TrainingRun, saved: list[dict[str, Any]]) -> None:
    """Loader records of a resume for `ShardedLoader` objects the program has not made yet:
    the next ones made while ``run`` is current take them, in order. Replaces what was
    waiting."""
    run.waiting[:] = list(saved)


def _check_splittable(sampler: Iterable[Any]) -> None:
    """Refuse a sampler whose order `shard` would not keep (it would silently read another
    order: every sample once per epoch, in order or in a seeded shuffle)."""
    if isinstance(sampler, (SequentialSampler, DistributedSampler)):
        return
    if isinstance(sampler, RandomSampler):
        if sampler.replacement or sampler.num_samples != len(sampler.data_source):
            raise UnsupportedProgramError(
                f"parallax.shard over a RandomSampler with replacement={sampler.replacement}, "
                f"num_samples={sampler.num_samples} (dataset of {len(sampler.data_source)}): "
                f"the workers' parts are a split of one permutation of every sample per "
                f"epoch; use RandomSampler without replacement and num_samples, or "
                f"shuffle=True")
        return
    raise UnsupportedProgramError(
        f"parallax.shard cannot split the order of a {type(sampler).__name__}: it keeps "
        f"SequentialSampler (shuffle=False), RandomSampler (shuffle=True) and "
        f"DistributedSampler orders; build the DataLoader with one of those, or give each "
        f"worker its own part of the data without parallax.shard")


def _dataset_size(dataset: Any) -> int:
    """A map-style dataset's length (`shard` refuses the others)."""
    if not isinstance(dataset, Sized):
        raise ArgumentTypeError(f"{type(dataset).__name__} has no __len__: parallax.shard "
                                f"needs a map-style dataset")
    return len(dataset)


def _draws_a_seed(sampler: Iterable[Any]) -> bool:
    return isinstance(sampler, RandomSampler) and sampler.generator is None


def set_data_parallel(run: TrainingRun, *, replicas: int, index: int,
                      group_size: int) -> None:
    """In ``run`` this worker reads as data replica ``index`` of ``replicas``, with the other
    ``group_size - 1`` workers of its model group (`parallax.parallelism`): every loader of
    the run, the ones no run holds yet, and every later one of the run."""
    run.data_parallel = (replicas, index, group_size)
    for loader in run_loaders(run) + unbound_loaders():
        if loader.grid != run.data_parallel:
            loader.regrid(replicas, index, group_size)


def clear_data_parallel(run: TrainingRun) -> None:
    """In ``run`` every worker reads as its own data replica (its loaders, and the ones no
    run holds yet, which an earlier model-parallel run of this process may have regridded)."""
    run.data_parallel = None
    for loader in run_loaders(run) + unbound_loaders():
        default = (loader.worker.world_size, loader.worker.rank, 1)
        if loader.grid != default:
            loader.regrid(*default)
