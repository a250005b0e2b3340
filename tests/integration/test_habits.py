"""Every habit of tests/habits.py tried through `parallax.distribute`: what works trains the
single-device program's parameters (float64, <= 1e-9), what is refused fails at its first use
with an `UnsupportedProgramError` naming the parameter, the rank and the line; docs/habits.md
is `habits.render_table()`.

One worker in this process for most; one 2-worker launch (tests/scripts/habits_worker.py)
for the habits whose difference needs several workers (averaging, samplers, the random
stream, rank-0-only saving)."""

from __future__ import annotations

import copy
import io
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from habits import (
    BY_KEY,
    HABITS,
    batches,
    build,
    classes,
    dataset,
    distributed,
    render_table,
    single_device,
)

import parallax
from parallax.errors import UnsupportedProgramError

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "scripts" / "habits_worker.py"
TRIED: set[str] = set()


def tries(*keys: str):
    """Mark a test as the one that tries these habits (each habit must have one)."""
    for key in keys:
        assert key in BY_KEY, key
        TRIED.add(key)
    return lambda test: test


def assert_equal(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        difference = float((got[name] - value).abs().max())
        assert difference <= 1e-9 * max(1.0, float(value.abs().max())), (
            f"{what}: {name} differs by {difference:.3g}")


@tries(*[h.key for h in HABITS if h.program is not None and not h.config])
@pytest.mark.parametrize("key", [h.key for h in HABITS if h.program is not None
                                 and not h.config])
def test_a_working_habit_trains_as_one_device(key: str, single_process) -> None:
    habit = BY_KEY[key]
    assert_equal(distributed(habit, 1, 0), single_device(habit), key)


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("habits")
    cmd = [sys.executable, "-m", "parallax.cli", "run", "--machines", "1",
           "--nproc-per-machine", "2", str(WORKER), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


@tries("sum_loss_summed", "grads_by_hand_replicated")
@pytest.mark.parametrize("key", [h.key for h in HABITS if h.launched and h.outcome == "works"])
def test_a_working_habit_trains_as_one_device_on_two_workers(key: str, launched: Path) -> None:
    assert_equal(torch.load(launched / f"{key}.pt"), single_device(BY_KEY[key]), key)


@tries("sum_loss_averaged")
def test_a_sum_loss_averaged_over_workers_is_one_over_w_of_the_update(launched: Path) -> None:
    """What the table calls 'works differently': averaged over the 2 workers, a sum loss's
    gradient is half one device's, so plain SGD at lr 0.1 equals one device at lr 0.05 (the
    summed configuration is exact, tried above)."""
    model, _, _ = build(BY_KEY["canonical"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for ids, y in batches(1, 0):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(ids), y, reduction="sum").backward()
        optimizer.step()
    assert_equal(torch.load(launched / "sum_averaged.pt"), model.state_dict(), "sum averaged")


@tries("ignore_index_mean")
def test_a_mean_over_each_workers_count_is_ddps_not_one_devices(launched: Path) -> None:
    """What the table calls 'works differently': each of the 2 workers divides its cross
    entropy by its own targets not ignored, so the run is the mean of the workers' means
    (DDP's), not one device's (`parallax.global_mean`'s row is exact, tried above)."""
    got = torch.load(launched / "ignore_index_mean.pt")
    one_device = single_device(BY_KEY["ignore_index_mean"])
    assert max(float((got[k] - v).abs().max()) for k, v in one_device.items()) > 1e-4
    model, optimizer, _ = build(BY_KEY["ignore_index_mean"])
    for ids, _ in batches(1, 0):
        optimizer.zero_grad()
        output, target = model(ids), classes(ids)
        (sum(torch.nn.functional.cross_entropy(output[w::2], target[w::2]) for w in range(2))
         / 2).backward()
        optimizer.step()
    assert_equal(got, model.state_dict(), "mean of the workers' means")


@tries("lr_per_worker")
def test_settings_that_differ_between_workers_are_refused_at_the_step(launched: Path) -> None:
    """Rank 1's learning rate doubled rank 0's in step 2: both ranks stop there, naming the
    setting and each rank's value (nothing trained apart)."""
    for rank in range(2):
        said = (launched / f"lr-{rank}.txt").read_text()
        assert said.startswith(f"rank {rank}: the workers' optimizers step with different "
                               f"settings in step 2"), said
        assert "param group 0's 'lr' differs: rank 0 0.05, rank 1 0.1" in said, said
        assert "all_reduce" in said


@tries("lr_per_worker")
def test_settings_that_differ_between_workers_are_refused_under_runner_step(
        launched: Path) -> None:
    """The same under `Runner.step` (get_runner's door, no loop order check): refused in step 2
    before anything is updated, riding in the push (a server-held embedding) or alone (a
    dense-only model)."""
    for rank in range(2):
        said = (launched / f"lr-runner-{rank}.txt").read_text().splitlines()
        assert [line.split(":")[0] for line in said] == ["embedding", "dense"], said
        for line in said:
            assert f"rank {rank}: the workers' optimizers step with different settings in " \
                   f"step 2" in line, line
            assert "param group 0's 'lr' differs: rank 0 0.05, rank 1 0.1" in line, line


@tries("dense_sometimes")
def test_a_layer_some_steps_skip_is_named_with_the_parallax_setting(launched: Path) -> None:
    """Without Config(find_unused_parameters=True) the second step's forward stops every
    rank, naming the unused layer's parameters and the setting, DDP's error chained (on
    26b56e5: DDP's raw advice to pass find_unused_parameters=True to a
    DistributedDataParallel the program never built)."""
    for rank in range(2):
        said = (launched / f"dense-sometimes-{rank}.txt").read_text()
        assert said.startswith(f"rank {rank}: the dense parameter(s) ['extra.weight', "
                               f"'extra.bias'] got no gradient in step 2"), said
        assert "parallax.Config(find_unused_parameters=True)" in said, said
        assert "caused by: Expected to have finished reduction" in said, said


@tries("evaluate_rank0")
def test_evaluation_on_rank_0_alone_is_named_at_once_on_every_rank(launched: Path) -> None:
    """Rank 0 evaluates after step 1, rank 1 goes on to step 2: both stop at that forward
    with the habit and its fixes (on 26b56e5 rank 0 waited the collective timeout, then a
    StalledRankError blamed rank 1's forward)."""
    for rank in range(2):
        said = (launched / f"evaluate-rank0-{rank}.txt").read_text()
        assert said.startswith(f"rank {rank}: the ranks' training loops diverged: rank 0 "
                               f"called a forward without gradients (evaluation) in step 2, "
                               f"rank 1 a forward of the model in step 2"), said
        assert "evaluating on rank 0 alone cannot run" in said and "plain copy" in said, said


@tries("batch_sampler")
def test_a_plain_batch_sampler_is_tried_by_the_loader_tests() -> None:
    """tests/unit/test_loader_resume.py shards both loaders on a stand-in worker and compares
    their batches over two epochs; a batch sampler of the program's own is refused there."""
    text = (ROOT / "tests" / "unit" / "test_loader_resume.py").read_text()
    assert "def test_a_plain_batch_sampler_is_split_as_its_sampler_and_batch_size" in text
    assert "class Bucketing(BatchSampler)" in text


@tries("distributed_sampler")
def test_a_ddp_distributed_sampler_keeps_its_shuffle_and_set_epoch(launched: Path) -> None:
    """Two epochs of a DDP loader (DistributedSampler(shuffle=True, seed=3), set_epoch(e))
    through parallax.shard equal one device with the same sampler at world size 1."""
    assert_equal(torch.load(launched / "sampler.pt"), _one_device_sampler_run(), "sampler")


@tries("dropout_rng", "random_sampler")
def test_the_programs_random_stream_goes_on_as_on_one_device(launched: Path) -> None:
    """Right after distribute every worker draws what the program draws at that point; after
    a shuffled epoch through shard too (its sampler's one draw is taken), and the epoch
    covered every sample once across the workers."""
    torch.manual_seed(7)
    first = torch.rand(4)
    for _ in torch.utils.data.DataLoader(dataset(), batch_size=4, shuffle=True):
        pass
    after_epoch = torch.rand(4)
    seen = []
    for rank in range(2):
        got = torch.load(launched / f"rng-{rank}.pt")
        assert torch.equal(got["after_distribute"], first), rank
        assert torch.equal(got["after_epoch"], after_epoch), rank
        seen.append(got["seen"])
    ids = dataset().tensors[0][:, 0]
    assert sorted(torch.cat(seen).tolist()) == sorted(ids.tolist())


def _distributed_net(single_process):
    model, optimizer, _ = build(BY_KEY["canonical"])
    dmodel, doptimizer = parallax.distribute(model, optimizer,
                                             config=parallax.Config(partition_cache=None))
    ids, y = dataset().tensors
    torch.nn.functional.mse_loss(dmodel(ids[:8]), y[:8]).backward()
    return dmodel, doptimizer


def _refused(action, *words: str) -> str:
    with pytest.raises(UnsupportedProgramError) as error:
        action()
    message = str(error.value)
    for word in words:
        assert word in message, message
    return message


NAMED = ("rank 0", "'embedding.weight'", "test_habits.py:")


@tries("torch_clip_all")
def test_torchs_clip_grad_norm_over_every_parameter_is_refused(single_process) -> None:
    model, _ = _distributed_net(single_process)
    _refused(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0), *NAMED,
             "parallax.clip_grad_norm_")


@tries("torch_clip_value_all")
def test_torchs_clip_grad_value_over_every_parameter_is_refused(single_process) -> None:
    model, _ = _distributed_net(single_process)
    message = _refused(lambda: torch.nn.utils.clip_grad_value_(model.parameters(), 0.1),
                       *NAMED, "parallax.clip_grad_value_")
    assert "clip_grad_norm_" not in message  # the fix keeps clipping by value


@tries("retained_graph")
def test_a_second_backward_through_one_forward_is_refused(single_process) -> None:
    """Also for two losses of one output; a backward per forward (accumulation) still works."""
    model, optimizer, _ = build(BY_KEY["canonical"])
    model, optimizer = parallax.distribute(model, optimizer,
                                           config=parallax.Config(partition_cache=None))
    ids, y = dataset().tensors
    out = model(ids[:8])
    torch.nn.functional.mse_loss(out, y[:8]).backward(retain_graph=True)
    _refused(lambda: out.sum().backward(), "rank 0", "second backward",
             "(loss1 + loss2).backward()")
    optimizer.zero_grad()
    for part in (slice(0, 4), slice(4, 8)):  # one forward, one backward each
        torch.nn.functional.mse_loss(model(ids[part]), y[part]).backward()
    optimizer.step()


@tries("inner_zero_grad")
def test_the_inner_modules_zero_grad_is_refused(single_process) -> None:
    model, _ = _distributed_net(single_process)
    _refused(lambda: model.module.zero_grad(), *NAMED, "zero_grad() on the model")


@tries("manual_update")
def test_a_manual_update_is_refused(single_process) -> None:
    model, _ = _distributed_net(single_process)

    def update() -> None:
        for p in model.module.parameters():
            p.data.add_(p.grad, alpha=-0.1)
    _refused(update, *NAMED, "torch.optim optimizer")


@tries("new_optimizer")
def test_an_optimizer_built_after_distribute_is_refused(single_process) -> None:
    model, _ = _distributed_net(single_process)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _refused(optimizer.step, "rank 0", "'embedding.weight'", "parallax.distribute did not "
             "return")


@tries("inner_state_dict")
def test_the_inner_modules_state_dict_is_refused(single_process) -> None:
    model, _ = _distributed_net(single_process)
    _refused(lambda: model.module.state_dict(), *NAMED, "collective")
    _refused(lambda: model.module.embedding.state_dict(), *NAMED)


@tries("pickle")
def test_pickling_or_copying_the_model_is_refused(single_process) -> None:
    model, _ = _distributed_net(single_process)
    _refused(lambda: torch.save(model, io.BytesIO()), "model.state_dict()", "test_habits.py:")
    _refused(lambda: pickle.dumps(model), "model.state_dict()")
    _refused(lambda: copy.deepcopy(model), "model.state_dict()")
    _refused(lambda: torch.save(model.module, io.BytesIO()), *NAMED, "pickling")
    _refused(lambda: torch.save(model.module.embedding, io.BytesIO()), *NAMED, "pickling")
    _refused(lambda: torch.optim.swa_utils.AveragedModel(model.module), *NAMED, "copying")


@tries("param_outside_model")
def test_a_parameter_outside_the_model_is_refused(single_process) -> None:
    model, _, _ = build(BY_KEY["canonical"])
    scale = torch.nn.Parameter(torch.ones((), dtype=torch.float64))
    optimizer = torch.optim.Adam([*model.parameters(), scale], lr=0.1)
    _refused(lambda: parallax.distribute(model, optimizer), "parameter 3 (shape ())",
             "not a parameter of the model", "Register it on the model")


@tries("init_after")
def test_initialising_a_server_held_parameter_after_distribute_is_refused(
        single_process) -> None:
    model, _ = _distributed_net(single_process)

    def init(module: torch.nn.Module) -> None:
        if isinstance(module, torch.nn.Embedding):
            torch.nn.init.normal_(module.weight)
    _refused(lambda: model.apply(init), *NAMED, "initialise the model before")
    _refused(lambda: model.module.embedding.reset_parameters(), *NAMED,
             "initialise the model before")
    _refused(lambda: model.module.embedding.weight.uniform_(), *NAMED,
             "initialise the model before")
    model.apply(lambda m: torch.nn.init.zeros_(m.bias) if isinstance(m, torch.nn.Linear)
                else None)  # dense layers are the real tensors: initialised in place
    assert float(model.module.head.bias.abs().max()) == 0.0


@tries("ddp_program")
def test_a_ddp_program_trains_as_one_device_with_the_wrap_alone(launched: Path) -> None:
    """tests/scripts/habits_worker.py's DDP program (it initialises the process group and
    wraps in DDP itself; its DistributedSampler loader is not sharded by parallax) equals one
    device reading the same sampler's global order."""
    assert_equal(torch.load(launched / "ddp.pt"), _one_device_sampler_run(), "ddp program")
    assert (launched / "ddp-retired.txt").read_text().startswith("this DistributedDataParallel")
    # its fp16 comm hook is said to be unused (the float64 equality above shows it was not:
    # fp16 sums would differ far beyond 1e-9); one registered on parallax's model is refused
    assert "comm hook(s) ['fp16_compress_hook'] are not used" in (
        launched / "ddp-log.txt").read_text()
    hooked = (launched / "ddp-hook.txt").read_text()
    assert "rank 0" in hooked and "Config.dense_sync" in hooked and "habits_worker.py:" in hooked


def _one_device_sampler_run() -> dict:
    """Two epochs of DistributedSampler(shuffle=True, seed=3) at world size 1, batch 8."""
    model, optimizer, _ = build(BY_KEY["canonical"])
    data = dataset()
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0, shuffle=True,
                                                  seed=3)
    loader = torch.utils.data.DataLoader(data, batch_size=8, sampler=sampler)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for ids, y in loader:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(ids), y).backward()
            optimizer.step()
    return model.state_dict()


@tries("load_differs")
def test_ranks_loading_different_values_are_refused_on_every_rank(launched: Path) -> None:
    for rank in range(2):
        said = (launched / f"load-{rank}.txt").read_text()
        assert "rank 1 passed a different 'head.bias' than rank 0" in said, said
        assert "habits_worker.py:" in said
        assert "barrier" in said


@tries("uneven_epoch")
def test_an_uneven_epoch_is_tried_by_the_verify_tests() -> None:
    """tests/integration/test_verify.py runs parallax verify on examples/uneven_epoch.py:
    the padded last step is named (exit 1); with drop_last both runs read the same global
    batches (the habit's fix, tests/unit/test_verify_parts.py)."""
    text = (ROOT / "tests" / "integration" / "test_verify.py").read_text()
    assert "uneven_epoch.py" in text and "at step 7" in text
    parts = (ROOT / "tests" / "unit" / "test_verify_parts.py").read_text()
    assert "(101, True, 6)" in parts


@tries("move_after")
def test_moving_or_casting_after_distribute_is_refused(single_process) -> None:
    model, _ = _distributed_net(single_process)
    assert model.double() is model and model.to("cpu") is model  # nothing changes: no-op
    _refused(lambda: model.float(), "rank 0", "head.weight", "before "
             "parallax.distribute", "test_habits.py:")
    _refused(lambda: model.module.float(), *NAMED, "before parallax.distribute")


@tries("requires_grad_after")
def test_freezing_or_unfreezing_a_dense_parameter_after_distribute_is_refused(
        single_process) -> None:
    """Refused at the next training forward (the dense sync took the parameters requiring
    gradients when it was built); an eval forward under no_grad is not a step."""
    model, optimizer = _distributed_net(single_process)
    ids, y = dataset().tensors
    optimizer.step()
    model.module.head.weight.requires_grad_(False)
    with torch.no_grad():
        model(ids[:4])
    _refused(lambda: model(ids[:4]), "rank 0", "'head.weight' (frozen)", "before the forward "
             "of step 2", ".grad = None")
    model.module.head.weight.requires_grad_(True)
    model.module.head.bias.requires_grad_(False)
    model.module.head.bias.requires_grad_(True)  # back as it was: trains on
    torch.nn.functional.mse_loss(model(ids[:4]), y[:4]).backward()
    optimizer.step()


@tries("batchnorm")
def test_batchnorm_layers_are_named_at_the_start_when_several_workers_train(caplog) -> None:
    """Exact on one worker (test_a_working_habit_trains_as_one_device); on several each
    worker's batch statistics differ from the global batch's, which rank 0 says once."""
    from parallax.model.exactness import warn_per_worker_statistics

    model = BY_KEY["batchnorm"].net()
    with caplog.at_level("WARNING", logger="parallax"):
        assert warn_per_worker_statistics(model, 1) == []
        assert not caplog.records
        assert warn_per_worker_statistics(model, 4) == ["norm"]
    message = caplog.records[-1].getMessage()
    assert "'norm' is a BatchNorm layer" in message and "4 workers" in message
    assert "as under DDP" in message and "SyncBatchNorm" in message


@tries("compiled_model")
def test_a_compiled_module_holding_a_table_is_refused(single_process) -> None:
    for compile_what in ("model", "submodule"):
        model, optimizer, _ = build(BY_KEY["canonical"])
        if compile_what == "model":
            model, where = torch.compile(model, backend="eager"), "the model itself"
            table = "'_orig_mod.embedding.weight'"
        else:
            model.embedding = torch.compile(model.embedding, backend="eager")
            where, table = "module 'embedding'", "'embedding._orig_mod.weight'"
        _refused(lambda m=model, o=optimizer: parallax.distribute(
                     m, o, config=parallax.Config(partition_cache=None)),
                 "rank 0", where, table, "torch.compile", "._orig_mod")


@tries("torch_scaler")
def test_torchs_grad_scaler_is_refused(single_process) -> None:
    model, optimizer, _ = build(BY_KEY["canonical"])
    model, optimizer = parallax.distribute(model, optimizer,
                                           config=parallax.Config(partition_cache=None))
    scaler = torch.amp.GradScaler("cpu")
    ids, y = dataset().tensors
    scaler.scale(torch.nn.functional.mse_loss(model(ids[:8]), y[:8])).backward()
    _refused(lambda: scaler.step(optimizer), "parallax.GradScaler")


@tries("other_sampler")
def test_a_sampler_shard_cannot_split_is_refused(monkeypatch) -> None:
    from parallax.cluster import WorkerInfo
    data = dataset()
    weighted = torch.utils.data.WeightedRandomSampler(torch.ones(len(data)), len(data))
    loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=weighted)
    monkeypatch.setattr("parallax.loader.current_worker", lambda: WorkerInfo.__new__(WorkerInfo))
    _refused(lambda: parallax.shard(loader), "WeightedRandomSampler", "DistributedSampler")


@tries("many_runs")
def test_many_runs_in_one_process_are_tried_by_the_runs_tests() -> None:
    """tests/integration/test_runs.py: six programs one after another in one process (both
    doors, a save and a later program's resume, model parallelism, a re-run), each equal to
    one device; tests/integration/test_checkpoint.py: a resume on another shape by processes
    that trained two programs first."""
    runs = (ROOT / "tests" / "integration" / "test_runs.py").read_text()
    assert "def test_each_program_of_the_process_equals_one_device" in runs
    checkpoints = (ROOT / "tests" / "integration" / "test_checkpoint.py").read_text()
    assert '"--trained-before"' in checkpoints


@tries("state_dict_everywhere", "state_dict_rank0")
def test_state_dicts_are_tried_by_the_own_loop_tests() -> None:
    """tests/integration/test_own_loop.py: the state dict saved on every rank equals one
    device's (outputs), rank 0 alone is refused naming the collective (save-on-0)."""
    text = (ROOT / "tests" / "integration" / "test_own_loop.py").read_text()
    assert "test_outputs_beyond_the_loss_equal_one_device_for_each_slice" in text
    assert '"save-on-0"' in text and "collective" in text


def test_every_habit_is_tried_and_the_docs_show_the_table() -> None:
    """Runs last in this module: every habit of the table has its test, and docs/habits.md
    carries the table as rendered from tests/habits.py (the README links there)."""
    assert TRIED == set(BY_KEY), sorted(set(BY_KEY) - TRIED)
    table = render_table()
    for page in (ROOT / "docs" / "habits.md",):
        assert table in page.read_text(), f"{page} does not carry habits.render_table()"
