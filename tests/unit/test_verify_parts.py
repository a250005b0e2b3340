"""parallax verify's pieces in one process: the comparison of recorded states, the report,
the reference run's plain-PyTorch recorder and its global-batch loader, the command's
argument checks."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch import nn

from parallax.cli import main
from parallax.cluster import WorkerInfo
from parallax.errors import VerifyComplete
from parallax.loader import ShardedLoader
from parallax.session import single_process_worker
from parallax.verify.command import VerifyOptions, report
from parallax.verify.compare import compare_runs, recorded_steps
from parallax.verify.record import VERIFY_ENV, Verification, step_file
from parallax.verify.reference import reference_pair


def write_run(directory: Path, states: list[dict[str, torch.Tensor]]) -> Path:
    directory.mkdir(parents=True)
    for step, state in enumerate(states):
        torch.save(state, step_file(directory, step))
    return directory


def states(steps: int, bump: dict[int, float] | None = None) -> list[dict]:
    """A weight and a bias per step; ``bump``: add this much to the weight from that step."""
    out = []
    for step in range(steps + 1):
        shift = sum(v for s, v in (bump or {}).items() if step >= s)
        out.append({"w": torch.full((3, 2), float(step), dtype=torch.float64) + shift,
                    "b": torch.arange(2, dtype=torch.float64) * step})
    return out


def test_equal_runs_compare_equal(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", states(4))
    b = write_run(tmp_path / "b", states(4))
    result = compare_runs(a, b, 1e-9)
    assert result.equal and result.steps == 4 and recorded_steps(a) == 4
    assert "EQUAL" in report(result, VerifyOptions("train.py"))


def test_a_divergence_is_found_at_its_first_step(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", states(5))
    b = write_run(tmp_path / "b", states(5, bump={3: 1e-6, 5: 1e-3}))
    result = compare_runs(a, b, 1e-9)
    assert not result.equal
    w, bias = result.tensors
    assert (w.name, w.first_step_above, w.at_step) == ("w", 3, 5)
    assert w.max_difference == pytest.approx(1e-3 + 1e-6)
    assert bias.first_step_above is None and bias.max_difference == 0.0
    text = report(result, VerifyOptions("train.py"))
    assert "DIFFERENT: 1 of 2 tensors went above 1e-09; the first at step 3: w" in text
    assert compare_runs(a, b, 1e-2).equal  # within a looser tolerance


def test_initial_values_that_differ_get_the_seeding_hint(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", states(2))
    b = write_run(tmp_path / "b", states(2, bump={0: 0.5}))
    text = report(compare_runs(a, b, 1e-9), VerifyOptions("train.py"))
    assert "before training (the initial values)" in text and "torch.manual_seed" in text


def test_structural_and_length_differences_are_not_equal(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", states(3))
    shorter = write_run(tmp_path / "short", states(2))
    result = compare_runs(a, shorter, 1e-9)
    assert not result.equal and result.steps == 2
    assert "the distributed run 2" in report(result, VerifyOptions("train.py"))
    other = [{**s, "extra": torch.zeros(1), "b": torch.zeros(3)} for s in states(3)]
    result = compare_runs(a, write_run(tmp_path / "other", other), 1e-9)
    assert not result.equal
    assert result.only_in_distributed == ["extra"]
    assert result.shape_mismatches == ["b: (2,) vs (3,)"]


def test_nans_in_both_runs_match_and_a_nan_in_one_is_infinite(tmp_path: Path) -> None:
    nan = [{"w": torch.tensor([float("nan"), float("inf"), 1.0])}] * 2
    one = [{"w": torch.tensor([float("nan"), float("inf"), 1.0])},
           {"w": torch.tensor([0.0, float("inf"), 1.0])}]
    assert compare_runs(write_run(tmp_path / "a", nan), write_run(tmp_path / "b", nan),
                        0.0).equal
    result = compare_runs(write_run(tmp_path / "c", nan), write_run(tmp_path / "d", one), 0.0)
    assert result.tensors[0].max_difference == float("inf")
    assert result.tensors[0].first_step_above == 1


def test_a_program_that_never_stepped_compares_nothing(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", states(0))
    result = compare_runs(a, write_run(tmp_path / "b", states(0)), 1e-9)
    assert not result.equal
    assert "NOTHING COMPARED" in report(result, VerifyOptions("train.py"))


def _reference_run(tmp_path: Path, monkeypatch, model: nn.Module, steps: int):
    """``model`` handed to a reference run of ``steps`` steps in this process: the wrapped
    model, its SGD optimizer, and a reader of the hints the run wrote."""
    import json

    from parallax.verify.record import RUN_FILE

    verification = Verification(str(tmp_path), "reference", steps, 2)
    monkeypatch.setenv(VERIFY_ENV, verification.to_env())
    single_process_worker()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = reference_pair(verification, model, [optimizer], timeout=timedelta(seconds=30))
    return wrapped, optimizer, lambda: json.loads((tmp_path / RUN_FILE).read_text())["hints"]


def test_the_reference_run_hints_at_autocast_once_a_module_runs_under_it(
        tmp_path: Path, single_process, monkeypatch) -> None:
    wrapped, optimizer, hints = _reference_run(
        tmp_path, monkeypatch, nn.Sequential(nn.Embedding(5, 2), nn.Linear(2, 1)), 3)
    ids = torch.tensor([[0, 1]])
    wrapped(ids).sum().backward()
    optimizer.step()
    assert not any("autocast" in hint for hint in hints())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        wrapped(ids).float().sum().backward()
    optimizer.step()
    autocast = [hint for hint in hints() if "autocast" in hint]
    assert autocast == [autocast[0]] and "(cpu, bfloat16)" in autocast[0]
    with pytest.raises(VerifyComplete):  # the last step ends the run (and the hook)
        wrapped(ids).sum().backward()
        optimizer.step()


def test_the_reference_records_plain_pytorch_steps_and_stops(tmp_path: Path,
                                                             single_process) -> None:
    """Two optimizers: a step is both having stepped; the run ends after the last step."""
    verification = Verification(str(tmp_path), "reference", 2, 2)
    single_process_worker()  # RANK=0, WORLD_SIZE=1, as parallax verify sets for it
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(5, 2), nn.Linear(2, 1))
    first = torch.optim.SGD(model[0].parameters(), lr=0.1)
    second = torch.optim.SGD(model[1].parameters(), lr=0.1)
    wrapped = reference_pair(verification, model, [first, second], timeout=timedelta(seconds=30))
    assert wrapped.module is model and wrapped.state_dict().keys() == model.state_dict().keys()
    ids = torch.tensor([[0, 1]])
    wrapped(ids).sum().backward()
    first.step()
    assert recorded_steps(tmp_path) == 0  # only one of the two optimizers stepped
    second.step()
    assert recorded_steps(tmp_path) == 1
    assert torch.equal(torch.load(step_file(tmp_path, 1))["1.weight"], model[1].weight)
    wrapped(ids).sum().backward()
    first.step()
    with pytest.raises(VerifyComplete):
        second.step()
    assert recorded_steps(tmp_path) == 2


def test_a_second_model_records_into_its_own_folder_and_compares_on_its_own(
        tmp_path: Path, single_process) -> None:
    """A program with two models (a GAN's pair): the second `distribute` records into
    model2/, each of its steps, and does not end the run; `compare_models` compares each
    model and reports each, one verdict per model."""
    from parallax.verify.command import compare_models
    from parallax.verify.record import model_folder

    runs = {}
    for role in ("reference", "distributed"):
        verification = Verification(str(tmp_path / role), role, 2, 2)
        single_process_worker()
        torch.manual_seed(0)
        gen, disc = nn.Linear(2, 2), nn.Linear(2, 1)
        if role == "distributed":
            with torch.no_grad():
                disc.bias += 1.0  # the second model differs, from its start
        g_opt = torch.optim.SGD(gen.parameters(), lr=0.1)
        d_opt = torch.optim.SGD(disc.parameters(), lr=0.1)
        wrapped_gen = reference_pair(verification, gen, [g_opt], timeout=timedelta(seconds=30))
        wrapped_disc = reference_pair(verification, disc, [d_opt],
                                      timeout=timedelta(seconds=30))
        x = torch.ones(3, 2)
        wrapped_disc(wrapped_gen(x)).sum().backward()
        d_opt.step()  # the second model's step 1: the run goes on
        g_opt.step()
        wrapped_disc(wrapped_gen(x)).sum().backward()
        with pytest.raises(VerifyComplete):  # the first model's last step ends the run
            g_opt.step()
        runs[role] = Path(verification.directory)
        assert recorded_steps(runs[role]) == 2
        assert recorded_steps(model_folder(runs[role], 2)) == 1
    comparisons = compare_models(runs["reference"], runs["distributed"], 1e-9)
    assert list(comparisons) == [1, 2]
    assert comparisons[1].equal and not comparisons[2].equal
    assert comparisons[2].above[0].name == "bias" and comparisons[2].steps == 1
    text = report(comparisons[2], VerifyOptions("gan.py"), model=2)
    assert "model 2 (the program's call 2 of parallax.distribute" in text
    assert "DIFFERENT: 1 of 2 tensors went above 1e-09; the first before training" in text


@pytest.mark.parametrize("size, drop_last, batches", [(40, False, 7), (101, True, 6)])
def test_the_reference_reads_the_distributed_runs_global_batches(size, drop_last, batches,
                                                                 monkeypatch) -> None:
    """The one-process reference's k-th batch holds the samples of the k-th batches of all
    W workers of the distributed run (with drop_last, also for a size W does not divide:
    the fix examples/uneven_epoch.py --drop-last verifies)."""
    data = torch.utils.data.TensorDataset(torch.arange(size))
    loader = torch.utils.data.DataLoader(data, batch_size=3 if size == 40 else 8,
                                         shuffle=True, drop_last=drop_last)

    def worker(world: int, rank: int) -> WorkerInfo:
        return WorkerInfo(rank=rank, world_size=world, local_rank=rank, machine=0,
                          num_machines=1, machine_of_rank=(0,) * world)

    parts = [[b[0].tolist() for b in ShardedLoader(loader, 0, worker(2, r))] for r in (0, 1)]
    monkeypatch.setenv(VERIFY_ENV, Verification("/nowhere", "reference", 5, 2).to_env())
    reference = [b[0].tolist() for b in ShardedLoader(loader, 0, worker(1, 0))]
    assert len(reference) == len(parts[0]) == len(parts[1]) == batches
    for k, batch in enumerate(reference):
        assert sorted(batch) == sorted(parts[0][k] + parts[1][k])


@pytest.mark.parametrize("args, says", [
    (["--steps", "0", "examples/uneven_epoch.py"], "--steps must be at least 1"),
    (["--machines", "0", "examples/uneven_epoch.py"], "--machines must be at least 1"),
    (["--tolerance", "-1", "examples/uneven_epoch.py"], "--tolerance must be"),
    (["no/such/train.py"], "no such script: no/such/train.py"),
])
def test_the_command_refuses_bad_arguments(args, says, capsys) -> None:
    assert main(["verify", *args]) == 2
    assert says in capsys.readouterr().err


def test_low_precision_parameters_get_the_precision_hint(tmp_path: Path) -> None:
    import json

    from parallax.verify.record import RUN_FILE, describe_run

    verification = Verification(str(tmp_path), "reference", 2, 2)
    describe_run(verification, nn.Linear(2, 2), "plain")
    assert json.loads((tmp_path / RUN_FILE).read_text())["hints"] == []
    describe_run(verification, nn.Linear(2, 2).to(torch.bfloat16), "plain")
    (hint,) = json.loads((tmp_path / RUN_FILE).read_text())["hints"]
    assert hint.startswith("parameters in bfloat16") and "--tolerance" in hint


def test_a_difference_from_the_first_update_gets_the_batch_coupling_hint(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", states(4))
    first = report(compare_runs(a, write_run(tmp_path / "b", states(4, bump={1: 1e-3})), 1e-9),
                   VerifyOptions("train.py"))
    assert "hint: the very first update differs" in first and "all_gather" in first
    later = report(compare_runs(a, write_run(tmp_path / "c", states(4, bump={3: 1e-3})), 1e-9),
                   VerifyOptions("train.py"))
    assert "very first update" not in later


def test_the_reference_run_hints_at_a_mean_over_each_workers_count(
        tmp_path: Path, single_process, monkeypatch) -> None:
    """F.cross_entropy / F.nll_loss (and their modules) averaging over the targets not
    ignored, or over class weights: named once, the functions put back at the run's end;
    a mean over every target, or a soft-label target, is not named."""
    functional = torch.nn.functional
    originals = functional.cross_entropy, functional.nll_loss
    wrapped, optimizer, every_hint = _reference_run(
        tmp_path, monkeypatch, nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 3)), 3)
    hints = lambda: [h for h in every_hint() if "global_mean" in h]  # noqa: E731
    ids = torch.tensor([0, 1, 2])
    out = wrapped(ids)
    functional.cross_entropy(out, torch.tensor([0, 1, 2])).backward(retain_graph=True)
    functional.cross_entropy(out, torch.softmax(out.detach(), 1)).backward(retain_graph=True)
    functional.nll_loss(out.log_softmax(1), torch.tensor([0, -100, 2]),
                        reduction="sum").backward(retain_graph=True)
    assert hints() == [] and functional.cross_entropy is not originals[0]
    nn.CrossEntropyLoss(ignore_index=2)(out, torch.tensor([0, 1, 2])).backward()
    optimizer.step()
    (said,) = hints()
    assert "F.cross_entropy" in said and "parallax.global_mean" in said
    assert (functional.cross_entropy, functional.nll_loss) == originals  # named once: put back
    wrapped(ids).sum().backward()
    optimizer.step()
    with pytest.raises(VerifyComplete):
        wrapped(ids).sum().backward()
        optimizer.step()


def test_the_reference_run_names_the_buffers_a_training_step_changed(
        tmp_path: Path, single_process, monkeypatch) -> None:
    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding = nn.Embedding(5, 2)
            self.norm = nn.BatchNorm1d(2)  # hinted apart: not named again
            self.register_buffer("seen", torch.zeros(()))
            self.register_buffer("fixed", torch.ones(2))

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            self.seen += len(ids)
            return self.norm(self.embedding(ids)) * self.fixed

    wrapped, optimizer, hints = _reference_run(tmp_path, monkeypatch, Counting(), 2)
    wrapped(torch.tensor([0, 1, 2])).sum().backward()
    optimizer.step()
    (said,) = [h for h in hints() if h.startswith("buffer(s)")]
    assert said.startswith("buffer(s) 'seen' changed in a training step")


def test_the_original_programs_model_and_global_batch_are_found(monkeypatch) -> None:
    """`parallax verify --reference`: the model recorded is the outermost module holding the
    stepping optimizer's parameters, and a DataLoader made in the original batches W times
    its batch_size (one with its own batch_sampler is left as it is)."""
    import torch
    from torch import nn
    from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

    from parallax.verify import original

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
            self.frozen = nn.Linear(2, 2)

    model = Outer()
    optimizer = torch.optim.SGD(model.inner[1].parameters(), lr=0.1)
    assert original.program_model(optimizer) is model
    monkeypatch.setattr(DataLoader, "__init__", DataLoader.__init__)  # put back after
    monkeypatch.setattr(original, "add_hint", lambda text: None)
    original._scale_loaders(3)
    data = list(range(12))
    assert DataLoader(data, batch_size=2).batch_size == 6
    assert DataLoader(data, 2, False).batch_size == 6
    batches = BatchSampler(SequentialSampler(data), 2, drop_last=False)
    assert len(list(DataLoader(data, batch_sampler=batches))) == 6


def test_the_report_says_the_states_real_dtype_and_blames_float32_rounding_alone(
        tmp_path: Path) -> None:
    """A program that builds its own float32 tensors (DLRM's, from numpy arrays) stays
    float32 under --dtype float64: the report says the states' dtype, and a difference within
    float32 rounding gets that hint, not the in-batch one (on 26b56e5 it said "float64" and
    blamed computations across the batch)."""
    def float32(steps: list[dict]) -> list[dict]:
        return [{k: v.float() for k, v in state.items()} for state in steps]

    a = write_run(tmp_path / "a", float32(states(3)))
    b = write_run(tmp_path / "b", float32(states(3, bump={1: 3e-7})))
    text = report(compare_runs(a, b, 1e-9), VerifyOptions("dlrm.py"))
    assert "states in float32 (asked: float64; the program builds these itself)" in text
    assert "within float32's rounding" in text and "--tolerance 1e-05" in text
    assert "in-batch negatives" not in text
    far = write_run(tmp_path / "c", float32(states(3, bump={1: 1e-2})))
    assert "float32's rounding" not in report(compare_runs(a, far, 1e-9),
                                              VerifyOptions("dlrm.py"))
