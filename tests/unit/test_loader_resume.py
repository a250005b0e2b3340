"""Loader positions: a checkpoint resumes the data stream where it stopped, on any worker count.

No process group: each test builds the loaders of all W workers in this one process by faking
`current_worker`, and steps them in lock step as a real job would.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset

import parallax
from parallax import loader as loader_module
from parallax import runs
from parallax.cluster import WorkerInfo
from parallax.errors import CheckpointError
from parallax.loader import (
    ShardedLoader,
    reachable_loaders,
    records,
    resume_later,
    resume_loaders,
    run_loaders,
)

SEED = 7


def _loaders(n: int, world: int, batch: int, *, shuffle: bool,
             drop_last: bool) -> list[ShardedLoader]:
    """The ShardedLoaders of ranks 0..world-1 over samples 0..n-1."""
    data = TensorDataset(torch.arange(n))
    loaders = []
    for rank in range(world):
        worker = WorkerInfo(rank=rank, world_size=world, local_rank=rank, machine=0,
                            num_machines=1, machine_of_rank=(0,) * world)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(loader_module, "current_worker", lambda worker=worker: worker)
            loader = parallax.shard(DataLoader(data, batch_size=batch, shuffle=shuffle,
                                               drop_last=drop_last), seed=SEED)
        assert isinstance(loader, ShardedLoader)
        loaders.append(loader)
    return loaders


def _global_batches(iterators: list[Iterator], steps: int | None = None) -> list[list[int]]:
    """Step all workers together; interleave their k-th batches back into global order
    (rank r's j-th sample of a batch is global position j*W + r within it)."""
    out = []
    for batches in zip(*iterators, strict=True):
        out.append(torch.stack([b[0] for b in batches], dim=1).flatten().tolist())
        if steps is not None and len(out) == steps:
            break
    return out


def _expected(n: int, world: int, batch: int, *, shuffle: bool, drop_last: bool,
              epoch: int) -> list[list[int]]:
    """The uninterrupted program's global batches of ``world * batch`` in an epoch: the epoch's
    permutation, cyclically padded to a multiple of ``world`` (drop_last False) or cut to whole
    global batches (drop_last True), as torch's DistributedSampler documents."""
    if shuffle:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(SEED + epoch)).tolist()
    else:
        order = list(range(n))
    size = world * batch
    if drop_last:
        order = order[:n // size * size]
    else:
        total = math.ceil(n / world) * world
        order = (order * world)[:total]
    return [order[i:i + size] for i in range(0, len(order), size)]


def _positions(loaders: list[ShardedLoader]) -> dict[str, int]:
    positions = [loader.position() for loader in loaders]
    assert all(p == positions[0] for p in positions), positions
    return positions[0]


FLAGS = [(s, d) for s in (False, True) for d in (False, True)]


@pytest.mark.parametrize(("shuffle", "drop_last"), FLAGS)
@pytest.mark.parametrize(("n", "world"), [(24, 2), (29, 2), (29, 3), (7, 4)])
def test_workers_kth_batches_interleave_to_the_global_batch(n: int, world: int, shuffle: bool,
                                                            drop_last: bool) -> None:
    loaders = _loaders(n, world, 2, shuffle=shuffle, drop_last=drop_last)
    for epoch in range(2):
        got = _global_batches([iter(loader) for loader in loaders])
        assert got == _expected(n, world, 2, shuffle=shuffle, drop_last=drop_last, epoch=epoch)
        assert len(got) == len(loaders[0])
    single = _expected(n, 1, 2 * world, shuffle=shuffle, drop_last=drop_last, epoch=1)
    if drop_last:
        assert got == single
    else:  # the same samples; the last batch may carry up to W-1 padding duplicates
        assert sum(got, [])[:n] == sum(single, [])


def test_unshuffled_single_device_reference_is_the_plain_dataloader() -> None:
    data = TensorDataset(torch.arange(29))
    for drop_last in (False, True):
        plain = [b[0].tolist() for b in DataLoader(data, batch_size=6, drop_last=drop_last)]
        assert plain == _expected(29, 1, 6, shuffle=False, drop_last=drop_last, epoch=0)


def _stop_and_resume(n: int, steps: int, epochs_before: int, shuffle: bool,
                     drop_last: bool) -> None:
    """Run W=2 (b=3) for ``steps`` global batches, then resume on W'=3 (b=2) and W'=1 (b=6)."""
    flags = {"shuffle": shuffle, "drop_last": drop_last}
    old = _loaders(n, 2, 3, **flags)
    for _ in range(epochs_before):
        _global_batches([iter(loader) for loader in old])
    epoch = epochs_before
    full = _expected(n, 2, 3, **flags, epoch=epoch)
    steps = min(steps, len(full))
    done = _global_batches([iter(loader) for loader in old], steps) if steps else []
    assert done == full[:steps]
    position = _positions(old)
    if steps and steps == len(full):  # the last batch is out: the stream is at the next epoch
        assert position == {"epoch": epoch + 1, "samples": 0}
        epoch, steps = epoch + 1, 0
    else:
        assert position == {"epoch": epoch, "samples": steps * 6}

    for world, batch in ((3, 2), (1, 6)):
        new = _loaders(n, world, batch, **flags)
        for loader in new:
            loader.resume(position)
        assert _positions(new) == position
        expected = _expected(n, world, batch, **flags, epoch=epoch)
        rest = _global_batches([iter(loader) for loader in new])
        assert rest == expected[steps:], (world, batch)
        assert len(new[0]) == len(expected), "len() is a full epoch's"
        assert _positions(new) == {"epoch": epoch + 1, "samples": 0}
        following = _global_batches([iter(loader) for loader in new])
        assert following == _expected(n, world, batch, **flags, epoch=epoch + 1)


@pytest.mark.parametrize(("shuffle", "drop_last"), FLAGS)
@pytest.mark.parametrize("n", [24, 29, 31])
def test_resume_on_other_worker_counts_continues_the_stream(n: int, shuffle: bool,
                                                            drop_last: bool) -> None:
    for steps in range(6):
        _stop_and_resume(n, steps, 0, shuffle, drop_last)


@settings(max_examples=50, deadline=None)
@given(n=st.integers(1, 40), steps=st.integers(0, 8), epochs_before=st.integers(0, 1),
       shuffle=st.booleans(), drop_last=st.booleans())
def test_resume_property(n: int, steps: int, epochs_before: int, shuffle: bool,
                         drop_last: bool) -> None:
    _stop_and_resume(n, steps, epochs_before, shuffle, drop_last)


def test_position_counts_batches_of_a_resumed_epoch_and_resumes_again() -> None:
    flags = {"shuffle": True, "drop_last": False}
    first = _loaders(30, 2, 3, **flags)
    _global_batches([iter(loader) for loader in first], 2)
    second = _loaders(30, 3, 2, **flags)
    for loader in second:
        loader.resume(_positions(first))
    _global_batches([iter(loader) for loader in second], 1)
    assert _positions(second) == {"epoch": 0, "samples": 18}
    third = _loaders(30, 1, 6, **flags)
    third[0].resume(_positions(second))
    assert _global_batches([iter(third[0])]) == _expected(30, 1, 6, **flags, epoch=0)[3:]


def test_resume_at_a_sample_count_the_new_workers_cannot_split_names_both() -> None:
    (loader,) = _loaders(30, 1, 2, shuffle=False, drop_last=False)
    _global_batches([iter(loader)], 3)
    position = loader.position()
    assert position == {"epoch": 0, "samples": 6}
    for new in _loaders(30, 4, 1, shuffle=False, drop_last=False):
        with pytest.raises(ValueError, match=r"samples=6 on 4 workers.*global batch"):
            new.resume(position)


@pytest.mark.parametrize("bad", [{"epoch": 0}, {"epoch": -1, "samples": 0},
                                 {"epoch": 0, "samples": 1.5}, {"epoch": 0, "samples": 31},
                                 [0, 0]])
def test_resume_rejects_malformed_positions(bad: object) -> None:
    (loader,) = _loaders(30, 1, 2, shuffle=False, drop_last=False)
    with pytest.raises(ValueError, match="samples|position"):
        loader.resume(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("drop_last", [False, True])
def test_position_after_an_exhausted_epoch_is_the_next_epoch(drop_last: bool) -> None:
    (loader,) = _loaders(7, 1, 3, shuffle=True, drop_last=drop_last)
    assert loader.position() == {"epoch": 0, "samples": 0}
    batches = iter(loader)
    for _ in range(len(loader) - 1):
        next(batches)
    assert loader.position() == {"epoch": 0, "samples": 3 * (len(loader) - 1)}
    next(batches)  # the last batch: the epoch is used up before StopIteration
    assert loader.position() == {"epoch": 1, "samples": 0}
    assert list(batches) == []
    assert loader.position() == {"epoch": 1, "samples": 0}


def test_a_stale_iterator_does_not_move_the_position() -> None:
    (loader,) = _loaders(12, 1, 2, shuffle=False, drop_last=False)
    stale = iter(loader)
    next(stale)
    current = iter(loader)
    next(stale)
    next(current)
    assert loader.position() == {"epoch": 1, "samples": 2}


class _Runner:
    """What `parallax.runs` needs of a runner: something weakly referable."""


@pytest.fixture
def run_of() -> Iterator:
    """Begins training runs as runners do (`runs.join_run`); ends the current one after."""
    held: list[_Runner] = []

    def begin(*, stepped_before: bool = True) -> runs.TrainingRun:
        current = runs.current_run()
        if current is not None and stepped_before:
            current.stepped = True
        held.append(_Runner())
        return runs.join_run(held[-1])

    yield begin
    runs.end_run()


def test_a_run_holds_the_loaders_iterated_under_it_in_order(run_of) -> None:
    run = run_of()
    loaders = _loaders(8, 2, 2, shuffle=False, drop_last=False)
    assert run_loaders(run) == []  # made, not iterated: no run holds them yet
    for loader in reversed(loaders):
        iter(loader)
    assert run_loaders(run) == loaders[::-1]
    del loaders, loader
    gc.collect()
    assert run_loaders(run) == []


def test_a_later_runs_checkpoint_holds_only_its_own_loaders(run_of) -> None:
    """A process that trained before (a sweep, a notebook re-run): the earlier run's loaders,
    still alive, are neither saved by the later run nor given its resume's positions (on
    26b56e5 both were: the resume gave the first saved position to the earlier loader)."""
    gc.collect()  # no other test's loader left unbound
    first = run_of()
    old = _loaders(24, 1, 2, shuffle=False, drop_last=False)[0]
    list(old)  # the earlier run read its whole epoch
    second = run_of()
    assert second is not first
    (mine,) = _loaders(24, 1, 4, shuffle=True, drop_last=False)
    batches = iter(mine)
    next(batches), next(batches)
    saved = records(second)
    assert [record["position"] for record in saved] == [{"epoch": 0, "samples": 8}]
    third = run_of()
    (resumed,) = _loaders(24, 1, 4, shuffle=True, drop_last=False)  # made before the resume
    resume_loaders(third, saved)
    assert old.position() == {"epoch": 1, "samples": 0} and old.run is first
    assert [b[0].tolist() for b in resumed] == [b[0].tolist() for b in batches]


def test_a_resume_refuses_a_loader_that_reads_other_data(run_of) -> None:
    first = run_of()
    (loader,) = _loaders(24, 1, 2, shuffle=False, drop_last=False)
    next(iter(loader))
    saved = records(first)
    second = run_of()
    (other,) = _loaders(20, 1, 2, shuffle=False, drop_last=False)
    with pytest.raises(CheckpointError, match=r"'samples': 24.*'samples': 20.*same loaders"):
        resume_loaders(second, saved)
    resume_later(second, saved)  # waiting for a loader made after the resume: refused there
    with pytest.raises(CheckpointError, match="reads other|would continue another"):
        _loaders(12, 1, 2, shuffle=True, drop_last=False)
    del other


def test_a_model_group_reads_its_data_replicas_samples_and_returns_to_data_parallel(
        run_of) -> None:
    """`set_data_parallel` (a 2x2 grid): ranks 0, 1 read replica 0's and ranks 2, 3 replica
    1's samples, twice the batch each, and the global batch and positions stay those of four
    data-parallel workers; `clear_data_parallel` gives each rank its own samples back."""
    run = run_of()
    loaders = _loaders(24, 4, 2, shuffle=False, drop_last=False)  # one order every epoch
    plain = _global_batches([iter(loader) for loader in loaders], steps=2)
    try:
        for rank, loader in enumerate(loaders):  # what each rank's runner does for itself
            loader.regrid(2, rank // 2, 2)
        first = [next(iter(loader)) for loader in loaders]
        assert torch.equal(first[0][0], first[1][0]) and torch.equal(first[2][0], first[3][0])
        assert sorted(torch.cat([first[0][0], first[2][0]]).tolist()) == sorted(plain[0])
        assert all(loader.global_batch == 8 for loader in loaders)
        loader_module.set_data_parallel(run, replicas=2, index=0, group_size=2)
        assert all(loader.grid == (2, 0, 2) for loader in run_loaders(run))
    finally:
        loader_module.clear_data_parallel(run)
    assert [loader.grid for loader in loaders] == [(4, r, 1) for r in range(4)]
    assert _global_batches([iter(loader) for loader in loaders], steps=2) == plain


def test_loaders_shard_cannot_split_are_refused_with_the_way_to_split_them(monkeypatch) -> None:
    from torch.utils.data import BatchSampler, IterableDataset, SequentialSampler

    from parallax.errors import ArgumentTypeError

    class Stream(IterableDataset):
        def __iter__(self) -> Iterator[torch.Tensor]:
            return iter(torch.arange(8))

    worker = WorkerInfo(rank=0, world_size=2, local_rank=0, machine=0, num_machines=1,
                        machine_of_rank=(0, 0))
    monkeypatch.setattr(loader_module, "current_worker", lambda: worker)
    with pytest.raises(ArgumentTypeError, match="IterableDataset.*rank::world_size"):
        parallax.shard(DataLoader(Stream(), batch_size=2))
    data = TensorDataset(torch.arange(8))

    class Bucketing(BatchSampler):
        """A batch sampler of the program's own (its batches could be anything)."""

    batches = Bucketing(SequentialSampler(data), 2, drop_last=False)
    with pytest.raises(ArgumentTypeError, match=r"a Bucketing .*split them in the program"):
        parallax.shard(DataLoader(data, batch_sampler=batches))


def test_a_plain_batch_sampler_is_split_as_its_sampler_and_batch_size(monkeypatch) -> None:
    """``DataLoader(batch_sampler=BatchSampler(s, b, d))`` gives the batches of
    ``DataLoader(sampler=s, batch_size=b, drop_last=d)``: sharded alike."""
    from torch.utils.data import BatchSampler, RandomSampler

    worker = WorkerInfo(rank=1, world_size=2, local_rank=1, machine=0, num_machines=1,
                        machine_of_rank=(0, 0))
    monkeypatch.setattr(loader_module, "current_worker", lambda: worker)
    data = TensorDataset(torch.arange(22))
    by_sampler = parallax.shard(DataLoader(
        data, batch_sampler=BatchSampler(RandomSampler(data), 3, drop_last=True)))
    by_size = parallax.shard(DataLoader(data, sampler=RandomSampler(data), batch_size=3,
                                        drop_last=True))
    for _ in range(2):  # two epochs, each its own shuffle
        got = [batch[0].tolist() for batch in by_sampler]
        assert got == [batch[0].tolist() for batch in by_size] and len(got) == 3
    assert len(by_sampler) == len(by_size) == 3


def test_the_ports_inline_loader_reshuffles_each_epoch_and_is_found_while_iterated(
        monkeypatch) -> None:
    """``for batch in parallax.shard(loader)`` inside an epoch loop (the README's port): the
    same DataLoader gives the same ShardedLoader, so each epoch is a new shuffle, and a
    checkpoint taken mid-iteration finds it, even built inline."""
    import gc

    worker = WorkerInfo(rank=0, world_size=2, local_rank=0, machine=0, num_machines=1,
                        machine_of_rank=(0, 0))
    monkeypatch.setattr(loader_module, "current_worker", lambda: worker)
    loader = DataLoader(TensorDataset(torch.arange(32)), batch_size=2, shuffle=True)
    epochs = [[int(i) for (batch,) in parallax.shard(loader, seed=SEED) for i in batch]
              for _ in range(2)]
    assert parallax.shard(loader, seed=SEED) is parallax.shard(loader, seed=SEED)
    assert epochs[0] != epochs[1] and len(epochs[0]) == len(epochs[1]) == 16  # its half
    for step, _ in enumerate(parallax.shard(DataLoader(TensorDataset(torch.arange(8)),
                                                       batch_size=2))):
        gc.collect()
        (inline,) = [s for s in reachable_loaders() if len(s.original.dataset) == 8]
        # 2 batches a worker; after the last, the position is the next epoch's start
        assert inline.position() == [{"epoch": 0, "samples": 4}, {"epoch": 1, "samples": 0}][step]


def test_positions_of_a_resume_wait_for_the_loaders_made_after_it(monkeypatch, run_of) -> None:
    """The port makes its loader after parallax.distribute, which resumes: the checkpoint's
    position waits for it, for loaders made while its run is current."""
    run = run_of()
    worker = WorkerInfo(rank=0, world_size=2, local_rank=0, machine=0, num_machines=1,
                        machine_of_rank=(0, 0))
    monkeypatch.setattr(loader_module, "current_worker", lambda: worker)
    data = TensorDataset(torch.arange(16))
    resume_later(run, [{"position": {"epoch": 1, "samples": 8}, "loader": None}])
    late = parallax.shard(DataLoader(data, batch_size=2), seed=SEED)
    assert late.position() == {"epoch": 1, "samples": 8} and late.run is run
    assert [int(i) for (batch,) in late for i in batch] == list(range(8, 16))[::2]
    other = parallax.shard(DataLoader(data, batch_size=2), seed=SEED)
    assert other.position() == {"epoch": 0, "samples": 0}  # nothing left waiting


def test_a_shuffled_or_batch_as_item_loader_is_said_once_a_run_with_the_exact_alternative(
        run_of, caplog) -> None:
    """Rank 0 says, once per run, that shuffle=True is shard's seeded permutation (and how to
    get the same batches on one device), and that a batch_size=1 loader with its own collate
    deals whole items (DLRM's mini-batches) to the workers; a plain loader says nothing (on
    26b56e5 nothing was said at run time)."""
    import logging

    data = TensorDataset(torch.arange(8))
    run_of()
    with caplog.at_level(logging.WARNING, logger="parallax"):
        for _ in range(2):  # a new loader each epoch: said once
            (shuffled,) = _loaders(8, 1, 2, shuffle=True, drop_last=False)
            iter(shuffled)
        worker = WorkerInfo(rank=0, world_size=1, local_rank=0, machine=0, num_machines=1,
                            machine_of_rank=(0,))
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(loader_module, "current_worker", lambda: worker)
            iter(parallax.shard(DataLoader(data, batch_size=1, collate_fn=lambda items: items[0])))
            iter(parallax.shard(DataLoader(data, batch_size=2)))
    said = [r.getMessage() for r in caplog.records if r.name == "parallax"]
    assert len(said) == 2, said
    assert "shuffle=True" in said[0] and "DistributedSampler(dataset, num_replicas=1" in said[0]
    assert "whole mini-batch" in said[1] and "batch_size=b" in said[1]


def test_a_resumed_run_whose_first_step_took_no_saved_position_is_refused(run_of) -> None:
    """The checkpoint held a loader's position and the resumed program's first step came
    with no parallax.shard loader taking it (its data would start over under a model that
    goes on); once one took it, later ones may still wait (an evaluation loader made after
    the first step)."""
    from parallax.loader import check_resumed

    gc.collect()  # no other test's loader left unbound
    first = run_of()
    (loader,) = _loaders(24, 1, 2, shuffle=False, drop_last=False)
    next(iter(loader))
    saved = records(first) * 2  # a training and an evaluation loader, say
    second = run_of()
    resume_loaders(second, saved)
    with pytest.raises(CheckpointError, match=r"holds the position\(s\) of 2 parallax.shard "
                       r"loader\(s\).*no loader taking one"):
        check_resumed(second, 0)
    _loaders(24, 1, 2, shuffle=False, drop_last=False)  # made after the resume: takes one
    check_resumed(second, 0)
    assert len(second.waiting) == 1


def test_a_loader_the_program_dropped_is_not_saved(run_of) -> None:
    """An earlier epoch's inline loader, dropped, lives on in its cycle with its DataLoader
    until the collector runs: a checkpoint does not save its position (a resume would give
    it to the loader the program makes first)."""
    run = run_of()
    gc.disable()
    try:
        (old,) = _loaders(12, 1, 2, shuffle=False, drop_last=False)
        list(old)
        del old
        (current,) = _loaders(12, 1, 2, shuffle=False, drop_last=False)
        next(iter(current))
        assert len(run.loaders()) == 2  # the dropped one is still alive here
        assert [record["position"] for record in records(run)] == [current.position()]
    finally:
        gc.enable()
