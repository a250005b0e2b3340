"""A trace is used only while the Python values it read hold (`parallax.model.trace_reads`).

fx fixes every flag and number ``forward`` reads off a module at its value during the trace:
a model with hand-written gathers (run through its fx rewrite) traced in training mode would
compute its training branch in eval mode, silently; a look-ahead traced in training mode
would pull the training branch's ids in eval mode and fail. Here: what a trace reads and
writes, one trace per state, and both paths in one process against the plain program, through
``train()``/``eval()`` and an attribute the loop changes between steps."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

import parallax
from parallax.errors import UnsupportedProgramError
from parallax.model.trace_reads import TraceCache, recording


class Branchy(nn.Module):
    """A hand-written gather, a branch on the mode and a number read off the module."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(40, 4, dtype=torch.float64))
        self.out = nn.Linear(4, 3).double()
        self.scale = 1.0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pooled = F.embedding(ids, self.weight).mean(dim=1)
        if self.training:
            pooled = pooled * 2.0
        return self.out(pooled * self.scale)


class PicksIds(nn.Module):
    """An nn.Embedding whose ids depend on the mode: the look-ahead's program does too."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(40, 4).double()
        self.out = nn.Linear(4, 3).double()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.training:
            ids = ids[:, :2]
        return self.out(self.embedding(ids).mean(dim=1))


class Counts(Branchy):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.calls = getattr(self, "calls", 0) + 1
        return super().forward(ids)


def _trace(model: nn.Module) -> tuple[fx.Graph, object]:
    tracer = fx.Tracer()
    with recording(model, lambda m, path: not tracer.is_leaf_module(m, path)) as reads:
        graph = tracer.trace(model)
    return graph, reads


def test_a_trace_holds_while_the_values_it_read_do() -> None:
    model = Branchy()
    _, reads = _trace(model)
    assert reads.hold()
    model.eval()
    assert not reads.hold()
    model.train()
    assert reads.hold()
    model.scale = 0.5
    assert not reads.hold()
    model.scale = 1  # an int is not the float read
    assert not reads.hold()


def test_what_a_trace_writes_is_recorded_and_undone() -> None:
    model = Counts()
    model.calls = 7
    _, reads = _trace(model)
    assert [(type(m).__name__, name) for m, name in reads.writes] == [("Counts", "calls")]
    assert model.calls == 7 and type(model) is Counts  # as before the trace


def test_the_cache_traces_once_per_state() -> None:
    model = Branchy()
    made = []

    def make() -> tuple[str, object]:
        made.append(model.training)
        return f"trace {len(made)}", _trace(model)[1]

    cache = TraceCache(make, what="test")
    for mode in (True, False, True, False, True):
        model.train(mode)
        cache.get()
    assert made == [True, False]


@pytest.fixture
def _shutdown():
    yield
    parallax.shutdown()


def _batches(steps: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The same ``steps`` batches (ids, classes) for the plain and the distributed program."""
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        yield (torch.randint(0, 40, (4, 5), generator=generator),
               torch.randint(0, 3, (4,), generator=generator))


def _side_by_side(model_class: type[nn.Module]) -> tuple[
        nn.Module, torch.optim.Optimizer, nn.Module, nn.Module, torch.optim.Optimizer]:
    """The plain program's model and SGD, and a copy of them through `parallax.distribute`:
    ``(plain, plain_opt, mine, model, opt)``, ``mine`` the program's own module."""
    torch.manual_seed(0)
    plain = model_class()
    mine = copy.deepcopy(plain)
    # (the warm-up outlasts the tests' steps: after it, a world of one runs the program's
    # own module, with no trace to read; `tests/unit/test_world_of_one.py`)
    model, opt = parallax.distribute(mine, torch.optim.SGD(mine.parameters(), lr=0.1),
                                     config=parallax.Config(partition_cache=None,
                                                            sparsity_warmup_steps=50))
    return plain, torch.optim.SGD(plain.parameters(), lr=0.1), mine, model, opt


@pytest.mark.usefixtures("_shutdown")
@pytest.mark.parametrize("model_class", [Branchy, PicksIds])
def test_eval_and_an_attribute_changed_by_the_loop_run_as_the_plain_program(
        model_class: type[nn.Module]) -> None:
    plain, plain_opt, mine, model, opt = _side_by_side(model_class)
    for step, (ids, y) in enumerate(_batches(6)):
        for net, optimizer, own in ((plain, plain_opt, plain), (model, opt, mine)):
            if hasattr(own, "scale"):  # set by the loop between steps, on its own module
                own.scale = 1.0 + step / 4  # (as under DDP: model.module.scale)
            net.train(step % 3 != 2)  # an eval forward every third step
            optimizer.zero_grad()
            loss = F.cross_entropy(net(ids), y)
            if net.training:
                loss.backward()
                optimizer.step()
        got, want = model.state_dict(), plain.state_dict()
        assert all(torch.allclose(got[k], want[k], rtol=0, atol=1e-12) for k in want), step
        model.eval(), plain.eval()
        with torch.no_grad():
            assert torch.allclose(model(ids), plain(ids), rtol=0, atol=1e-12)


@pytest.mark.usefixtures("_shutdown")
def test_a_forward_that_writes_an_attribute_beside_hand_written_gathers_is_refused() -> None:
    model = Counts()
    with pytest.raises(UnsupportedProgramError, match=r"Counts.forward sets self.calls: "
                                                      r"parallax runs a model with hand-written "
                                                      r"row gathers \(\['weight'\]\)"):
        parallax.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            config=parallax.Config(partition_cache=None))


@pytest.mark.usefixtures("_shutdown")
def test_evaluate_between_steps_of_the_runner_reads_the_tables_that_train() -> None:
    """`Runner.step` with one worker: after the warm-up the hybrid moves the table to
    AllReduce (a table replaced under the traces); evaluation between steps then traces the
    eval branch with the new table, and training goes on with it."""
    torch.manual_seed(0)
    plain = Branchy()
    mine = copy.deepcopy(plain)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    runner = parallax.get_runner(mine, torch.optim.SGD(mine.parameters(), lr=0.1),
                                 lambda out, y: F.cross_entropy(out, y),
                                 config=parallax.Config(partition_cache=None,
                                                        sparsity_warmup_steps=2))
    for step, (ids, y) in enumerate(_batches(6)):
        runner.step((ids, y))
        plain_opt.zero_grad()
        F.cross_entropy(plain(ids), y).backward()
        plain_opt.step()
        plain.eval()
        with torch.no_grad():
            want = float(F.cross_entropy(plain(ids), y))
        plain.train()
        assert abs(runner.evaluate([(ids, y)]) - want) <= 1e-12, step
    assert "replicated" in runner.plan.table().split("weight", 1)[1].splitlines()[0]
    got, want_state = runner.state_dict(), plain.state_dict()
    assert all(torch.allclose(got[k], want_state[k], rtol=0, atol=1e-12) for k in want_state)


@pytest.mark.usefixtures("_shutdown")
def test_wrapping_a_model_runs_none_of_its_forward_s_side_effects() -> None:
    """Finding the sparse parameters and the look-ahead trace the forward: the call counter
    it bumps stays as it was; a forward that runs bumps the program's own module's."""

    class Counted(PicksIds):
        calls = 0

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return super().forward(ids)

    model = Counted()
    model, _ = parallax.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                   config=parallax.Config(partition_cache=None))
    assert model.module.calls == 0
    model(torch.randint(0, 40, (2, 5)))
    assert model.module.calls == 1


class Tallied(PicksIds):
    """Keeps a call counter (which changes nothing it computes), and makes a tensor of a
    number (a trace keeps that tensor as a constant of its own)."""

    calls = 0
    offset = 0.0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls < 0:
            raise AssertionError("never")
        return super().forward(ids) + torch.tensor(self.offset, dtype=torch.float64)


class Scaled(Tallied):
    """Its output depends on its call counter (the ids do not)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * (1.0 + 0.01 * (self.calls % 3))


def test_a_trace_equal_to_a_kept_one_drops_the_values_they_differ_in() -> None:
    model = Tallied()
    made = []

    def make() -> tuple[fx.GraphModule, object]:
        tracer = fx.Tracer()
        with recording(model, lambda m, path: not tracer.is_leaf_module(m, path)) as reads:
            traced = fx.GraphModule(model, tracer.trace(model))
        made.append(1)
        return traced, reads

    from parallax.model.trace_reads import same_traced
    cache = TraceCache(make, what="test", same=same_traced)
    first = cache.get()
    for calls in range(1, 6):
        model.calls = calls
        assert cache.get() is not None
    assert len(made) == 2  # the counter changed once more than it mattered: then no longer
    model.offset = 0.5  # the constant differs: a trace of its own, not merged
    second = cache.get()
    assert second is not first and len(made) == 3
    zeros = torch.zeros(1, 5, dtype=torch.long)
    assert torch.allclose(second(zeros) - first(zeros), torch.tensor(0.5, dtype=torch.float64))


@pytest.mark.usefixtures("_shutdown")
def test_a_forward_that_keeps_a_counter_runs_as_the_plain_program() -> None:
    plain, plain_opt, mine, model, opt = _side_by_side(Scaled)
    for ids, y in _batches(5):
        for net, optimizer in ((plain, plain_opt), (model, opt)):
            optimizer.zero_grad()
            F.cross_entropy(net(ids), y).backward()
            optimizer.step()
    assert mine.calls == plain.calls == 5
    got, want = model.state_dict(), plain.state_dict()
    assert all(torch.allclose(got[k], want[k], rtol=0, atol=1e-12) for k in want)
    assert model.runner.forward_pass._id_programs.made <= 2


class _NoSubclasses(type(nn.Module)):
    def __new__(mcls, name: str, bases: tuple, namespace: dict) -> type:  # noqa: N804
        if "__getattribute__" in namespace:
            raise TypeError(f"{name}: no subclasses that watch attributes")
        return super().__new__(mcls, name, bases, namespace)


class Odd(PicksIds, metaclass=_NoSubclasses):
    """A module class whose metaclass refuses the watching subclass: traced unwatched."""


@pytest.mark.usefixtures("_shutdown")
def test_a_module_that_cannot_be_watched_is_traced_as_it_is() -> None:
    model = Odd()
    model, opt = parallax.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                     config=parallax.Config(partition_cache=None))
    ids, y = torch.randint(0, 40, (4, 5)), torch.randint(0, 3, (4,))
    F.cross_entropy(model(ids), y).backward()
    opt.step()
    assert model.runner.forward_pass.id_program is not None  # (looked ahead all the same)
