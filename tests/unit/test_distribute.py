"""`parallax.distribute` in one process: the user's module and optimizer surface (what the
forward returns, state dicts, train/eval, lr schedulers) and the misuse it names."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from torch import nn

import parallax
from parallax.errors import UnsupportedProgramError


class Tagged(nn.Module):
    """Returns a structure, has a method of its own and a dropout (train/eval differ)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(30, 4)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(4, 3)

    def forward(self, ids: torch.Tensor, scale: float = 1.0) -> dict:
        logits = self.head(self.drop(self.embedding(ids).mean(dim=1))) * scale
        return {"logits": logits, "tag": "ok", "count": ids.shape[0]}

    def describe(self) -> str:
        return "tagged"


def _train(steps: range, *pairs: tuple[nn.Module, torch.optim.Optimizer]) -> None:
    """The plain loop on ``_batch(step)`` for each step, each (model, optimizer) in turn."""
    for step in steps:
        ids, y = _batch(step)
        for net, opt in pairs:
            opt.zero_grad()
            nn.functional.cross_entropy(net(ids)["logits"], y).backward()
            opt.step()


def _assert_same(got: dict, want: dict) -> None:
    """Two state dicts (model's, or an optimizer's ``state``) equal to 1e-12."""
    assert got.keys() == want.keys()
    for key, value in want.items():
        if isinstance(value, dict):
            _assert_same(got[key], value)
        else:
            torch.testing.assert_close(got[key], value, rtol=1e-12, atol=1e-12, msg=str(key))


def _pair(optimizer_class=torch.optim.Adagrad, **kwargs):
    torch.manual_seed(0)
    model = Tagged().double()
    reference = Tagged().double()
    reference.load_state_dict(model.state_dict())
    distributed, optimizer = parallax.distribute(
        model, optimizer_class(model.parameters(), lr=0.1, **kwargs),
        config=parallax.Config(partition_cache=None))
    return distributed, optimizer, reference, optimizer_class(reference.parameters(), lr=0.1,
                                                              **kwargs)


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(30, (6, 4), generator=generator), torch.randint(3, (6,),
                                                                        generator=generator)


def test_forward_returns_the_modules_structure_and_trains_as_one_device(single_process):
    """Keyword arguments in, a dict with non-tensors out; in eval mode (no dropout) five
    steps of the plain loop with an lr scheduler equal the single-device program."""
    model, optimizer, reference, reference_optimizer = _pair()
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5)
                  for o in (optimizer, reference_optimizer)]
    model.eval()
    reference.eval()
    for step in range(5):
        ids, y = _batch(step)
        for net, opt, sched in ((model, optimizer, schedulers[0]),
                                (reference, reference_optimizer, schedulers[1])):
            opt.zero_grad()
            out = net(ids, scale=2.0)
            assert out["tag"] == "ok" and out["count"] == 6
            nn.functional.cross_entropy(out["logits"], y).backward()
            opt.step()
            sched.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.025)
    state = model.state_dict()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-12, atol=1e-12, msg=name)
    assert model.describe() == "tagged"  # the user's own methods
    assert isinstance(optimizer, torch.optim.Adagrad)


def test_train_and_eval_reach_the_module_that_runs(single_process):
    """eval(): no dropout, the same outputs twice; train(): dropout again."""
    model, _, reference, _ = _pair()
    ids, _ = _batch(0)
    model.eval()
    reference.eval()
    with torch.no_grad():
        first = model(ids)["logits"]
        torch.testing.assert_close(first, model(ids)["logits"])
        torch.testing.assert_close(first, reference(ids)["logits"])
    model.train()
    with torch.no_grad():
        assert not torch.equal(model(ids)["logits"], model(ids)["logits"])


def test_an_evaluation_under_inference_mode_gives_the_single_device_outputs(single_process):
    """Ids made under torch.inference_mode (an evaluation loop's habit), after training steps:
    the same outputs as the single-device model's, and training goes on after it."""
    model, optimizer, reference, reference_optimizer = _pair()
    model.eval()
    reference.eval()
    _train(range(2), (model, optimizer), (reference, reference_optimizer))
    with torch.inference_mode():
        ids, _ = _batch(7)
        torch.testing.assert_close(model(ids)["logits"], reference(ids)["logits"],
                                   rtol=1e-12, atol=1e-12)
    _train(range(2, 4), (model, optimizer), (reference, reference_optimizer))
    _assert_same(model.state_dict(), reference.state_dict())


def test_load_state_dict_reaches_the_servers(single_process):
    """A single-device state dict loaded into the distributed model is what it computes
    with and what it exports, the server-held table included."""
    model, _, reference, _ = _pair()
    torch.manual_seed(5)
    other = Tagged().double()
    model.load_state_dict(other.state_dict())
    model.eval()
    other.eval()
    ids, _ = _batch(1)
    with torch.no_grad():
        torch.testing.assert_close(model(ids)["logits"], other(ids)["logits"])
    for name, value in other.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=0, atol=0)


def test_clip_grad_norm_includes_the_servers_rows(single_process):
    """parallax.clip_grad_norm_ returns and applies the norm torch's computes on one device
    over every gradient, the embedding's included."""
    model, optimizer, reference, reference_optimizer = _pair(torch.optim.SGD)
    model.eval()
    reference.eval()
    ids, y = _batch(2)
    nn.functional.cross_entropy(model(ids)["logits"], y).backward()
    nn.functional.cross_entropy(reference(ids)["logits"], y).backward()
    norm = parallax.clip_grad_norm_(model.parameters(), 0.01)
    want = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01)
    torch.testing.assert_close(norm, want.double(), rtol=1e-12, atol=0)
    optimizer.step()
    reference_optimizer.step()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=1e-12, atol=1e-12)


def test_step_without_a_forward_is_named(single_process):
    model, optimizer, _, _ = _pair()
    with pytest.raises(UnsupportedProgramError, match="rank 0: a gradient update with no "
                       "forward through the distributed model"):
        optimizer.step()


def test_a_parameter_in_no_optimizer_is_refused():
    model = Tagged()
    with pytest.raises(UnsupportedProgramError, match=r"\['head.weight', 'head.bias'\] "
                       "require gradients but are in none of the optimizers"):
        parallax.distribute(model, torch.optim.SGD(model.embedding.parameters(), lr=0.1))


def test_a_server_held_table_read_in_the_loop_trains_as_one_device_and_a_write_is_refused(
        single_process):
    """The user's copy of a server-held table has no storage: its shape and dtype answer; a
    value read from the program's code (a penalty on the table's norm and on rows it indexes
    itself, in the loss) reads the whole table through the run, its gradient rows pushed with
    the step's: three steps equal one device's (on 26b56e5 both reads were refused); a write
    and ``.grad`` are refused at once, naming the parameter, the rank and the line."""
    model, optimizer, reference, reference_optimizer = _pair(torch.optim.Adam)
    model.eval(), reference.eval()  # no dropout
    weight = model.module.embedding.weight
    assert weight.shape == (30, 4) and weight.dtype == torch.float64
    for step in range(3):
        ids, y = _batch(step)
        for net, opt in ((model, optimizer), (reference, reference_optimizer)):
            opt.zero_grad()
            table = net.embedding.weight
            penalty = 0.1 * table.norm() + 0.01 * table[ids[:, 0]].pow(2).sum()
            (nn.functional.cross_entropy(net(ids)["logits"], y) + penalty).backward()
            opt.step()
    _assert_same(model.state_dict(), reference.state_dict())
    with pytest.raises(UnsupportedProgramError, match=r"rank 0: parameter 'embedding.weight' "
                       r"lives on the parameter servers .* 'mul_' on it at "
                       r".*test_distribute.py:\d+"), torch.no_grad():
        weight.mul_(0.5)  # a manual update
    with pytest.raises(UnsupportedProgramError, match="'grad' on it"):
        weight.grad.sum()


def test_a_non_finite_norm_raises_when_asked_and_clips_nothing(single_process):
    """``error_if_nonfinite=True``, as torch's: a NaN in a server-held table's aggregated
    gradient raises a RuntimeError naming the norm, and no gradient is scaled (under
    ``Config(nonfinite="ignore")``: the default check raises at the push already)."""
    torch.manual_seed(0)
    model, reference = Tagged().double(), Tagged().double()
    reference.load_state_dict(model.state_dict())
    model, _ = parallax.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                   config=parallax.Config(partition_cache=None,
                                                          nonfinite="ignore"))
    ids, y = _batch(2)
    nn.functional.cross_entropy(model(ids)["logits"] * float("nan"), y).backward()
    nn.functional.cross_entropy(reference(ids)["logits"] * float("nan"), y).backward()
    with pytest.raises(RuntimeError, match="non-finite"):
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01, error_if_nonfinite=True)
    head = model.module.head.weight.grad.clone()
    with pytest.raises(parallax.NonFiniteError, match="norm of order 2.0 .* is nan") as error:
        parallax.clip_grad_norm_(model.parameters(), 0.01, error_if_nonfinite=True)
    assert isinstance(error.value, RuntimeError)
    torch.testing.assert_close(model.module.head.weight.grad, head, equal_nan=True)
    norm = parallax.clip_grad_norm_(model.parameters(), 0.01, foreach=True)  # torch's default
    assert torch.isnan(norm)


def test_norms_other_than_l2_are_refused(single_process):
    model, _, _, _ = _pair()
    with pytest.raises(UnsupportedProgramError, match="norm_type=2.0"):
        parallax.clip_grad_norm_(model.parameters(), 1.0, norm_type=float("inf"))


def test_torch_grad_scaler_is_refused_not_half_applied(single_process):
    """torch's GradScaler would unscale only the replicated gradients: refused, naming the
    one that works."""
    model, optimizer, _, _ = _pair()
    scaler = torch.amp.GradScaler("cpu")
    ids, y = _batch(0)
    scaler.scale(nn.functional.cross_entropy(model(ids)["logits"], y)).backward()
    with pytest.raises(UnsupportedProgramError, match="use parallax.GradScaler"):
        scaler.step(optimizer)


def test_parallax_grad_scaler_skips_and_trains_as_torch_on_one_device(single_process):
    """A first scale that overflows: the same steps are skipped, the scale backs off and
    grows the same, and the parameters end equal (float32, servers' rows included)."""
    torch.manual_seed(0)
    model, reference = Tagged(), Tagged()
    reference.load_state_dict(model.state_dict())
    distributed, optimizer = parallax.distribute(
        model, torch.optim.Adam(model.parameters(), lr=0.01),
        config=parallax.Config(partition_cache=None))
    reference_optimizer = torch.optim.Adam(reference.parameters(), lr=0.01)
    settings = {"init_scale": 2.0 ** 120, "growth_interval": 2}
    initial = {k: v.clone() for k, v in reference.state_dict().items()}
    scalers = [parallax.GradScaler("cpu", **settings), torch.amp.GradScaler("cpu", **settings)]
    distributed.eval()
    reference.eval()
    scales = []
    for step in range(8):
        ids, y = _batch(step)
        for net, opt, scaler in ((distributed, optimizer, scalers[0]),
                                 (reference, reference_optimizer, scalers[1])):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(ids)["logits"], y) * 256  # overflows
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        scales.append((scalers[0].get_scale(), scalers[1].get_scale()))
    assert all(a == b for a, b in scales), scales
    assert len({a for a, _ in scales}) > 1, "the scale backed off and grew"
    assert all(not torch.equal(reference.state_dict()[k], v) for k, v in initial.items())
    state = distributed.state_dict()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-6, atol=1e-7, msg=name)
    assert distributed.runner.global_step == 8


def test_optimizer_state_loaded_before_distribute_reaches_the_servers(single_process):
    """Resuming a single-device run: model and Adam state loaded into fresh objects, then
    distributed; three more steps equal the single-device program continuing (the servers'
    rows start from the loaded moments and step count, not from fresh ones)."""
    torch.manual_seed(0)
    single = Tagged().double()
    single.eval()
    single_optimizer = torch.optim.Adam(single.parameters(), lr=0.05)
    _train(range(2), (single, single_optimizer))
    model = Tagged().double()
    model.load_state_dict(single.state_dict())
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    # (a copy: state_dict() hands out the live tensors, as a file would not)
    optimizer.load_state_dict(copy.deepcopy(single_optimizer.state_dict()))
    model, optimizer = parallax.distribute(model, optimizer,
                                           config=parallax.Config(partition_cache=None))
    model.eval()
    assert model.module.embedding.weight not in optimizer.state  # the servers hold it
    _train(range(2, 5), (model, optimizer), (single, single_optimizer))
    _assert_same(model.state_dict(), single.state_dict())


def test_optimizer_state_dict_is_the_single_device_one_and_loads_back(single_process):
    """optimizer.state_dict() holds the servers' Adam moments and step (3 partitions: rows
    reordered on the server), and a fresh distributed model and optimizer loaded with both
    state dicts continue exactly as the single-device program does."""
    torch.manual_seed(0)
    single = Tagged().double()
    single.eval()
    single_optimizer = torch.optim.Adam(single.parameters(), lr=0.05)
    config = parallax.Config(partition_cache=None, num_partitions=3)
    model = copy.deepcopy(single)
    model, optimizer = parallax.distribute(
        model, torch.optim.Adam(model.parameters(), lr=0.05), config=config)
    model.eval()
    _train(range(2), (model, optimizer), (single, single_optimizer))
    saved_model, saved = model.state_dict(), optimizer.state_dict()
    _assert_same(saved["state"], single_optimizer.state_dict()["state"])
    parallax.shutdown()

    model = Tagged().double()
    model, optimizer = parallax.distribute(
        model, torch.optim.Adam(model.parameters(), lr=0.05), config=config)
    model.eval()
    model.load_state_dict(saved_model)
    optimizer.load_state_dict(copy.deepcopy(saved))
    assert model.module.embedding.weight not in optimizer.state  # the servers hold it
    _train(range(2, 5), (model, optimizer), (single, single_optimizer))
    _assert_same(model.state_dict(), single.state_dict())


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward takes ``SLOW_S``: where the own loop's backward time goes."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(SLOW_S)
        return grad


SLOW_S = 0.2  # large against what a loaded host adds to "other" (it flaked at 0.05)


def test_the_users_own_backward_is_timed_as_the_backward_phase(single_process):
    """In the own loop ``loss.backward()`` is the user's call; its time is the step's
    backward phase (from the first gradient reaching the outputs to the backward's end),
    not ``other``."""
    model, optimizer = parallax.distribute(
        *_slow_pair(), config=parallax.Config(partition_cache=None))
    for step in range(3):
        ids, y = _batch(step)
        optimizer.zero_grad()
        logits = model(ids)
        nn.functional.cross_entropy(logits, y).backward()
        optimizer.step()
    phases = model.runner.stats()["step phases"]
    assert phases["backward"] >= SLOW_S, phases
    assert phases["other"] < SLOW_S / 2, phases


def _slow_pair() -> tuple[nn.Module, torch.optim.Optimizer]:
    class Slow(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding = nn.Embedding(30, 4)
            self.head = nn.Linear(4, 3)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(_SlowBackward.apply(self.embedding(ids).mean(dim=1)))

    torch.manual_seed(0)
    model = Slow()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


class _CountingSGD(torch.optim.SGD):
    """An optimizer class of the program's own, whose step reads every parameter's grad
    (the server-held ones too): parallax runs it, so the handles answer as plain tensors."""

    def step(self, closure=None):
        self.seen = [p.grad is None for group in self.param_groups for p in group["params"]]
        return super().step(closure)


@pytest.mark.parametrize("door", ["distribute", "get_runner"])
def test_an_optimizer_class_of_the_programs_own_trains_as_one_device(door, single_process):
    torch.manual_seed(0)
    model, reference = Tagged().double(), Tagged().double()
    reference.load_state_dict(model.state_dict())
    model.eval()
    reference.eval()
    optimizer = _CountingSGD(model.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    config = parallax.Config(partition_cache=None)

    def loss_fn(out, y):
        return nn.functional.cross_entropy(out["logits"], y)
    if door == "distribute":
        model, optimizer = parallax.distribute(model, optimizer, config=config)
        pairs = [(model, optimizer)]
    else:
        runner = parallax.get_runner(model, optimizer, loss_fn, config=config)
        runner.module.eval()
        pairs = []
    for step in range(3):
        ids, y = _batch(step)
        _train(range(step, step + 1), (reference, reference_optimizer), *pairs)
        if door == "get_runner":
            runner.step((ids, y))
    state = model.state_dict() if door == "distribute" else runner.state_dict()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-12, atol=1e-12, msg=name)


def test_freezing_a_server_held_parameter_after_distribute_is_refused(single_process):
    """requires_grad_ on a server-held parameter after distribute would not stop the
    servers' update: refused, naming the parameter; its metadata still answers."""
    model, _, _, _ = _pair()
    weight = model.module.embedding.weight
    assert weight.requires_grad and weight.device == torch.device("cpu")
    with pytest.raises(UnsupportedProgramError, match="'embedding.weight'.*set requires_grad "
                       "before parallax.distribute"):
        weight.requires_grad_(False)


class _ModeAware(nn.Module):
    """Its root's forward reads ``self.training`` (a copied ancestor of the embedding)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(10, 3)
        self.head = nn.Linear(3, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embedding(ids).mean(dim=1)
        return self.head(x * 100.0 if self.training else x)


def test_evaluate_runs_every_module_in_eval_and_gives_each_its_mode_back(single_process) -> None:
    torch.manual_seed(0)
    plain = _ModeAware().double().eval()
    model = copy.deepcopy(plain).train()
    ids, y = torch.randint(0, 10, (6, 2)), torch.randn(6, 1, dtype=torch.float64)
    runner = parallax.get_runner(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                 nn.functional.mse_loss,
                                 config=parallax.Config(partition_cache=None))
    model.head.eval()  # a layer the program keeps in eval mode
    loss = runner.evaluate([(ids, y)])
    assert loss == pytest.approx(float(nn.functional.mse_loss(plain(ids), y)), abs=1e-12)
    assert model.training and not model.head.training and model.embedding.training


def test_a_second_distribute_of_the_same_model_or_optimizer_is_refused(single_process) -> None:
    """A distribute per epoch: the optimizer passed the first time is the distributed one now;
    the returned pair passed back is named too."""
    model = torch.nn.Sequential(torch.nn.Embedding(5, 2), torch.nn.Linear(2, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    dmodel, doptimizer = parallax.distribute(model, optimizer,
                                             config=parallax.Config(partition_cache=None))
    with pytest.raises(parallax.UnsupportedProgramError,
                       match=r"rank 0: the optimizer DistributedAdam went through "
                             r"parallax.distribute already .* distribute once"):
        parallax.distribute(model, optimizer)
    with pytest.raises(parallax.UnsupportedProgramError,
                       match=r"the model \(DistributedModel\) and the optimizer"):
        parallax.distribute(dmodel, doptimizer)
