"""The habits of a plain PyTorch or DDP training loop, tried through `parallax.distribute`.

Each `Habit` is a piece of an ordinary program (its ``program`` runs unchanged on one device
and on the model and optimizer `parallax.distribute` returned) and what parallax does with it:
``works`` (the same parameters as the single-device program, float64, <= 1e-9), ``differs``
(works, but not as one device: ``note`` says how) or ``refused`` (an `UnsupportedProgramError`
naming the parameter, rank and fix at the first use). tests/integration/test_habits.py tries
every one; docs/habits.md is `render_table()` of this list (a test keeps them equal), and so
is the README's own-loop table.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import parallax

STEPS = 5
PER_WORKER = 4  # samples per worker and step; the single-device program takes W times that


class Net(nn.Module):
    """An embedding (server-held), a dropout and a dense head; ``init_hidden`` builds a
    tensor from ``next(self.parameters())`` as RNN programs do."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.embedding = nn.Embedding(40, 6)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(6, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        start = self.init_hidden(ids.shape[0])
        return self.head(self.drop(self.embedding(ids).mean(dim=1)) + start)

    def init_hidden(self, rows: int) -> torch.Tensor:
        weight = next(self.parameters())
        return weight.new_zeros(rows, 6).to(weight.device)


class SometimesNet(Net):
    """`Net` whose forward may leave the embedding out (a table some steps do not use)."""

    def forward(self, ids: torch.Tensor, use_table: bool = True) -> torch.Tensor:
        if use_table:
            return super().forward(ids)
        return self.head(self.init_hidden(ids.shape[0]) + ids.shape[1])


class SometimesDenseNet(Net):
    """`Net` with a dense layer its forward uses only when asked (an ``if`` in ``forward``)."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__(dropout)
        self.extra = nn.Linear(6, 6)

    def forward(self, ids: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        hidden = self.embedding(ids).mean(dim=1)
        return self.head(self.extra(hidden) if use_extra else hidden)


class ModeNet(Net):
    """`Net` whose forward branches on the mode: eval reads three ids of each sample (the
    look-ahead's ids differ by mode), and a number the loop sets scales the output.
    Traceable (no ``init_hidden``): its lookups are pulled ahead."""

    scale = 1.0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.training:
            ids = ids[:, :3]
        return self.head(self.drop(self.embedding(ids).mean(dim=1))) * self.scale


class BatchNormNet(Net):
    """`Net` with a BatchNorm layer before its head."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__(dropout)
        self.norm = nn.BatchNorm1d(6)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embedding(ids).mean(dim=1)))


class BufferNet(Net):
    """`Net` whose forward updates buffers from its batch in training: a count of the samples
    seen (in place, by a number: what a trace would run for real) and a running mean of the
    pooled embeddings that the output subtracts."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__(dropout)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))
        self.register_buffer("avg", torch.ones(6))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pooled = self.embedding(ids).mean(dim=1)
        if self.training:
            self.seen += 1
            self.avg.mul_(0.9).add_(pooled.detach().mean(dim=0), alpha=0.1)
        return self.head(pooled - self.avg * self.seen)


class CompiledHeadNet(Net):
    """`Net` whose dense head the program compiles (``torch.compile``, the eager backend: no
    C++ toolchain needed; the wrapping is what parallax meets, whatever the backend)."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__(dropout)
        self.head = torch.compile(self.head, backend="eager")  # type: ignore[assignment]


def dataset(size: int = 48) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(11)
    return torch.utils.data.TensorDataset(torch.randint(40, (size, 5), generator=generator),
                                          torch.randn(size, 3, generator=generator,
                                                      dtype=torch.float64))


def batches(world: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This worker's slices of the global batches (one device: world=1, the whole batch)."""
    ids, y = dataset().tensors
    size = PER_WORKER * 2  # the global batch of a 2-worker run
    out = []
    for step in range(STEPS):
        chunk = slice(step * size, (step + 1) * size)
        out.append((ids[chunk][rank::world], y[chunk][rank::world]))
    return out


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


@dataclass
class Run:
    """What a habit's program gets: the model and optimizer to train (the distributed ones,
    or the originals on one device), the original optimizer, this worker's batches."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    original_optimizer: torch.optim.Optimizer
    batches: list[tuple[torch.Tensor, torch.Tensor]]
    world: int
    rank: int
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Habit:
    key: str
    habit: str  # what the program does, as the user writes it
    outcome: str  # "works" | "differs" | "refused"
    note: str  # how it works, how it differs, or why it is refused and what to do
    program: Callable[[Run], Any] | None = None  # trains; None: tried by its own test
    dropout: float = 0.0
    config: dict[str, Any] = field(default_factory=dict)
    launched: bool = False  # tried on 2 workers (a launch), not only on one in-process
    net: type[Net] = Net


def _loop(run: Run, clear: Callable[[], None], step: Callable[[], Any] | None = None,
          loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = mse) -> None:
    for ids, y in run.batches:
        clear()
        loss(run.model(ids), y).backward()
        (step or run.optimizer.step)()


def _canonical(run: Run) -> None:
    _loop(run, run.optimizer.zero_grad)


def _compiled_after(run: Run) -> None:
    """``torch.compile`` of the model the program trains (the eager backend: no C++
    toolchain needed; dynamo's tracing is what parallax meets, whatever the backend)."""
    compiled = torch.compile(run.model, backend="eager")
    _loop(Run(compiled, run.optimizer, run.original_optimizer, run.batches, run.world,
              run.rank, run.extra), run.optimizer.zero_grad)


def _model_zero_grad(run: Run) -> None:
    _loop(run, run.model.zero_grad)


def _keep_zeros(run: Run) -> None:
    _loop(run, lambda: run.optimizer.zero_grad(set_to_none=False))


def _original_optimizer(run: Run) -> None:
    _loop(run, run.original_optimizer.zero_grad, run.original_optimizer.step)


def _scheduler_before(run: Run) -> None:
    scheduler = run.extra["scheduler"]
    for ids, y in run.batches:
        run.original_optimizer.zero_grad()
        mse(run.model(ids), y).backward()
        run.original_optimizer.step()
        scheduler.step()


def _parallax_clip(run: Run) -> None:
    def clip_and_step() -> None:
        parallax.clip_grad_norm_(run.model.parameters(), 0.05)
        run.optimizer.step()
    _loop(run, run.optimizer.zero_grad, clip_and_step)


def _parallax_clip_value(run: Run) -> None:
    def clip_and_step() -> None:
        parallax.clip_grad_value_(run.model.parameters(), 0.02)
        run.optimizer.step()
    _loop(run, run.optimizer.zero_grad, clip_and_step)


def _join(run: Run) -> None:
    """The loop inside DDP's ``join()`` (one device: no DDP, no join)."""
    from parallax.distributed import DistributedModel

    distributed = isinstance(run.model, DistributedModel)
    with run.model.join() if distributed else contextlib.nullcontext():
        _canonical(run)


def _torch_clip_dense(run: Run) -> None:
    def clip_and_step() -> None:
        torch.nn.utils.clip_grad_norm_(run.model.head.parameters(), 0.05)
        run.optimizer.step()
    _loop(run, run.optimizer.zero_grad, clip_and_step)


def _sum_loss(run: Run) -> None:
    _loop(run, run.optimizer.zero_grad,
          loss=lambda out, y: nn.functional.mse_loss(out, y, reduction="sum"))


def _dense_sometimes(run: Run) -> None:
    for step, (ids, y) in enumerate(run.batches):
        run.optimizer.zero_grad()
        mse(run.model(ids, use_extra=step % 2 == 0), y).backward()
        run.optimizer.step()


def _accumulate(run: Run) -> None:
    """Two micro-batches per step, the first under DDP's ``no_sync`` (one device: plain)."""
    for ids, y in run.batches:
        run.optimizer.zero_grad()
        half = ids.shape[0] // 2
        sync = getattr(run.model, "no_sync", None)
        with sync() if sync is not None else contextlib.nullcontext():
            (mse(run.model(ids[:half]), y[:half]) * half / ids.shape[0]).backward()
        (mse(run.model(ids[half:]), y[half:]) * (ids.shape[0] - half) / ids.shape[0]).backward()
        run.optimizer.step()


def _grads_by_hand(run: Run) -> None:
    """Every ``.grad`` changed between backward and step: halved, plus a hand-written decay."""
    def change_and_step() -> None:
        for param in run.model.parameters():
            if param.grad is not None:
                param.grad.mul_(0.5).add_(param.detach(), alpha=1e-3)
        run.optimizer.step()
    _loop(run, run.optimizer.zero_grad, change_and_step)


def _penalty_on_looked_up_rows(run: Run) -> None:
    """A penalty on the rows the batch looked up, computed in the loop by calling the
    model's embedding layer."""
    for ids, y in run.batches:
        run.optimizer.zero_grad()
        penalty = run.model.embedding(ids).pow(2).mean()
        (mse(run.model(ids), y) + 0.1 * penalty).backward()
        run.optimizer.step()


def _table_norm_penalty(run: Run) -> None:
    """A penalty on the whole table's norm in the loss."""
    for ids, y in run.batches:
        run.optimizer.zero_grad()
        (mse(run.model(ids), y) + 0.05 * run.model.embedding.weight.norm()).backward()
        run.optimizer.step()


def _grads_divided(run: Run) -> None:
    """Gradient accumulation normalised by hand: two backward passes, then every ``.grad``
    divided by their number before the step (server-held tables' too)."""
    for ids, y in run.batches:
        run.optimizer.zero_grad()
        half = ids.shape[0] // 2
        mse(run.model(ids[:half]), y[:half]).backward()
        mse(run.model(ids[half:]), y[half:]).backward()
        for param in run.model.parameters():
            if param.grad is not None:
                param.grad.div_(2)
        run.optimizer.step()


def _retained_graph(run: Run) -> None:
    """Two backward passes through one retained graph before one step."""
    for ids, y in run.batches:
        run.optimizer.zero_grad()
        loss = mse(run.model(ids), y)
        loss.backward(retain_graph=True)
        (0.5 * loss).backward()
        run.optimizer.step()


def _table_some_steps(run: Run) -> None:
    """Every other step leaves the embedding out: zero_grad() set its .grad to None, so
    Adam skips it there (no moment decay, no step count), as on one device."""
    for step, (ids, y) in enumerate(run.batches):
        run.optimizer.zero_grad()
        mse(run.model(ids, use_table=step % 2 == 0), y).backward()
        run.optimizer.step()


def _in_batch_gathered(run: Run) -> None:
    """A loss over every pair of the batch's samples (in-batch negatives): each worker's
    outputs against every worker's, gathered with autograd (one device: its own batch)."""
    import torch.distributed as dist
    from torch.distributed import _functional_collectives as funcol

    for ids, _ in run.batches:
        run.optimizer.zero_grad()
        out = run.model(ids)
        every = (funcol.all_gather_single_autograd(out, 0, dist.group.WORLD)
                 if dist.is_initialized() else out)
        rank = dist.get_rank() if dist.is_initialized() else 0
        logits = out @ every.T
        targets = torch.arange(len(ids)) + rank * len(ids)
        nn.functional.cross_entropy(logits, targets).backward()
        run.optimizer.step()


IGNORED = -100  # cross_entropy's default ignore_index


def classes(ids: torch.Tensor) -> torch.Tensor:
    """Class targets of ``ids`` (3 classes), about a third of them ignored (padding)."""
    return torch.where(ids[:, 1] % 3 == 0, IGNORED, ids[:, 0] % 3)


def _ignore_index_mean(run: Run) -> None:
    """A cross entropy averaged over the targets it does not ignore (the default mean)."""
    for ids, _ in run.batches:
        run.optimizer.zero_grad()
        nn.functional.cross_entropy(run.model(ids), classes(ids)).backward()
        run.optimizer.step()


def _global_mean(run: Run) -> None:
    """The same loss summed, over the targets not ignored of every worker."""
    for ids, _ in run.batches:
        run.optimizer.zero_grad()
        target = classes(ids)
        loss = nn.functional.cross_entropy(run.model(ids), target, reduction="sum")
        parallax.global_mean(loss, (target != IGNORED).sum()).backward()
        run.optimizer.step()


def _grad_none_some_steps(run: Run) -> None:
    """The dense head's weight kept fixed in the first two steps: its ``.grad`` set to None
    before ``optimizer.step()`` (the optimizer skips it, as it skips a frozen parameter)."""
    inner = getattr(run.model, "module", run.model)  # one device: the model itself
    for step, (ids, y) in enumerate(run.batches):
        run.optimizer.zero_grad()
        mse(run.model(ids), y).backward()
        if step < 2:
            inner.head.weight.grad = None
        run.optimizer.step()


def _hooks_after(run: Run) -> None:
    """After distribute: a forward hook on the model itself and on a layer, and a layer's
    attribute changed (dropout switched off)."""
    inner = getattr(run.model, "module", run.model)  # one device: the model itself
    inner.register_forward_hook(lambda module, args, output: output * 0.5)
    inner.head.register_forward_pre_hook(lambda module, args: (args[0] + 1.0,))
    inner.drop.p = 0.0
    _canonical(run)


def _eval_between(run: Run) -> None:
    """An eval forward before every step (its output shifts the step's target, so it must be
    the eval branch's), and a module attribute the loop changes between steps."""
    inner = getattr(run.model, "module", run.model)  # one device: the model itself
    for step, (ids, y) in enumerate(run.batches):
        inner.scale = 1.0 + step / 4
        run.model.eval()
        with torch.no_grad():
            shift = run.model(ids).mean()
        run.model.train()
        run.optimizer.zero_grad()
        mse(run.model(ids) + shift, y).backward()
        run.optimizer.step()


def _device_of_parameters(run: Run) -> None:
    device = next(run.model.parameters()).device  # where inputs go, as DDP programs ask
    for ids, y in run.batches:
        run.optimizer.zero_grad()
        mse(run.model(ids.to(device)), y.to(device)).backward()
        run.optimizer.step()


HABITS: list[Habit] = [
    Habit("canonical", "`optimizer.zero_grad(); loss.backward(); optimizer.step()`", "works",
          "the reference loop", _canonical, launched=True),
    Habit("model_zero_grad", "`model.zero_grad()` instead of `optimizer.zero_grad()`", "works",
          "clears the servers' gradient rows too", _model_zero_grad, launched=True),
    Habit("set_to_none_false", "`optimizer.zero_grad(set_to_none=False)`", "works",
          "gradients kept as zeros, as torch does", _keep_zeros),
    Habit("original_optimizer", "keep stepping the optimizer object passed to `distribute`",
          "works", "`distribute` turns that object into the distributed optimizer (the one "
          "it returns)", _original_optimizer, launched=True),
    Habit("scheduler_before", "an lr scheduler built on the optimizer before `distribute`",
          "works", "the scheduler's step counting follows the distributed step",
          _scheduler_before),
    Habit("dropout_rng", "dropout, and anything drawn from torch's generator after "
          "`distribute`", "works",
          "`distribute` leaves the program's random stream as it was (one worker: the same "
          "masks; several workers: each draws its own masks for its rows, as under DDP)",
          _canonical, dropout=0.5),
    Habit("table_some_steps", "a table not looked up in some steps, with `zero_grad()` "
          "(gradients set to None) and Adam", "works",
          "the servers skip the table in those steps, as torch skips a parameter whose "
          "`.grad` is None (no moment decay, no step count)", _table_some_steps,
          launched=True, net=SometimesNet),
    Habit("hooks_after", "forward hooks registered, or a layer's attribute changed (e.g. "
          "dropout's `p`), on `model.module` after `distribute`", "works",
          "the program's own modules run (the embedding layers' parents are copies kept in "
          "step with yours at every forward)", _hooks_after, dropout=0.5, launched=True),
    Habit("eval_between", "`model.eval()` forwards between steps of a `forward` that "
          "branches on `self.training`, and a module attribute the loop changes between "
          "steps (`model.module.scale = ...`)", "works",
          "each trace parallax takes of your forward (the id look-ahead; the rewrite of "
          "hand-written gathers) is used only while the flags and numbers it read hold: "
          "another is taken when they change", _eval_between, net=ModeNet),
    Habit("init_hidden", "`next(model.parameters())` for a hidden state "
          "(`weight.new_zeros(...)`) or for the device", "works",
          "a server-held parameter answers shape, dtype and `new_zeros`/`zeros_like`; "
          "`.device` is the worker's device", _device_of_parameters),
    Habit("in_batch_gathered", "a loss over every pair of the batch's samples (in-batch "
          "negatives), the other workers' outputs gathered with an all_gather that keeps the "
          "gradient (`_functional_collectives.all_gather_single_autograd`)", "works",
          "the gather keeps the gradient, so each worker's loss sees the global batch; "
          "without it each sees only its part, as under DDP, and `parallax verify` points "
          "at that", _in_batch_gathered, launched=True),
    Habit("ddp_join", "DDP's `with model.join():` around the loop", "works",
          "every worker takes the same steps (`parallax.shard` gives each the same batches); "
          "a rank that runs out early is named at the others' next step, inside `join()` as "
          "outside, instead of being shadowed", _join, launched=True),
    Habit("compiled_dense", "`torch.compile` of a submodule without tables before `distribute` "
          "(`model.head = torch.compile(model.head)`)", "works",
          "the compiled submodule holds only DDP's replicated parameters and runs compiled",
          _canonical, net=CompiledHeadNet),
    Habit("compiled_after", "`model = torch.compile(model)` after `distribute`", "works",
          "the distributed model's forward runs eagerly inside the compiled module (its "
          "lookups pull rows by collectives dynamo cannot trace yet): exact, not faster; "
          "compile the submodules without tables for their speed", _compiled_after,
          launched=True),
    Habit("batchnorm", "`nn.BatchNorm1d`/`2d` layers in training mode", "differs",
          "each worker normalises its own batch by that batch's statistics (running "
          "statistics from rank 0), as under DDP; parallax says so at the start (exact on one "
          "worker); `nn.SyncBatchNorm` (GPU) normalises by the global batch", _canonical,
          net=BatchNormNet),
    Habit("batch_buffers", "buffers the forward updates from its batch (a running mean, a "
          "count of steps)", "differs",
          "each worker updates them from its own part of the batch and the state dict holds "
          "rank 0's, as under DDP (exact on one worker); `parallax verify` names them",
          _canonical, net=BufferNet),
    Habit("no_sync", "DDP's `with model.no_sync():` for gradient accumulation", "works",
          "dense gradients AllReduced once, rows pushed once per step", _accumulate,
          launched=True),
    Habit("grads_by_hand_replicated", "every `p.grad` changed by hand between backward and "
          "step (scaled, a hand-written decay) under `architecture='allreduce'`", "works",
          "a replicated table's `.grad` is the workers' summed gradient once the backward "
          "ends, as DDP's dense ones (its rows go at the backward's end)", _grads_by_hand,
          config={"architecture": "allreduce"}, launched=True),
    Habit("dense_sometimes", "a dense layer the forward uses only in some steps (an `if` in "
          "`forward`), with `Config(find_unused_parameters=True)`", "works",
          "DDP's unused-parameter detection, as a DDP program needs; without it the next "
          "step's forward is refused on every rank, naming the layer's parameters and that "
          "setting (DDP's own error named a DDP argument the program never passes)",
          _dense_sometimes, config={"find_unused_parameters": True}, launched=True,
          net=SometimesDenseNet),
    Habit("evaluate_rank0", "evaluation on rank 0 alone between steps (`if rank == 0:` "
          "`with torch.no_grad(): model(val)`, the DDP habit of nanoGPT and others)", "refused",
          "a forward is collective (its rows come from every server): named at once on every "
          "rank, at the forward; evaluate on every rank (each its share, the metric "
          "all-reduced), or load `model.state_dict()` (collective) into a plain copy on rank 0",
          None),
    Habit("layer_in_loop", "the model's embedding layer called in the loop (a penalty on the "
          "rows the batch looked up: `loss + c * model.embedding(ids).pow(2).mean()`)",
          "works", "the call reads the rows through the table, as the model's own lookups "
          "do, and their gradient joins the step's push; collective: every rank makes it "
          "(one that does not is named at once)", _penalty_on_looked_up_rows, launched=True),
    Habit("table_norm_penalty", "a penalty on a whole table in the loss "
          "(`loss + c * model.embedding.weight.norm()`, any read of a server-held parameter's "
          "values in the program's code)", "works",
          "the read pulls the whole table through the run (collective: every rank makes it, "
          "in the loop's order) and its gradient rows join the step's push; costly for a "
          "large table: an L2 penalty `lam * w.pow(2).sum()` is cheaper as the optimizer's "
          "`weight_decay=2*lam` (SGD, Adam, Adagrad); a write (`w.mul_(...)`) stays refused",
          _table_norm_penalty, launched=True),
    Habit("grads_divided", "every `p.grad` scaled in place before `optimizer.step()` "
          "(`p.grad.div_(k)` after k accumulated backwards) under the default architecture",
          "works", "a server-held table's `.grad` answers in-place scaling by a number: its "
          "aggregated rows are scaled after the push (the workers' scaled rows sum to the "
          "scaled sum); any other use of it is refused (next rows)", _grads_divided,
          launched=True),
    Habit("retained_graph", "two `backward()` through one forward's outputs "
          "(`retain_graph=True`) before one step", "refused",
          "DDP averages the dense gradients once per forward, so the second backward's would "
          "not be; add the losses and call backward once, or run the forward again", None),
    Habit("parallax_clip", "`parallax.clip_grad_norm_(model.parameters(), c)`", "works",
          "the single-device global norm, servers' rows included", _parallax_clip,
          launched=True),
    Habit("parallax_clip_value", "`parallax.clip_grad_value_(model.parameters(), v)`", "works",
          "the aggregated gradients clamped, servers' rows included, as on one device",
          _parallax_clip_value, launched=True),
    Habit("torch_clip_dense", "`torch.nn.utils.clip_grad_norm_` over dense parameters only",
          "works", "their gradients are the AllReduced ones", _torch_clip_dense,
          launched=True),
    Habit("sum_loss_averaged", "a loss with `reduction='sum'`", "differs",
          "gradients are averaged over the W workers, as under DDP: the update is 1/W of "
          "one device's; `Config(average_dense=False, average_sparse=False)` sums them and "
          "trains exactly as one device", None),
    Habit("ignore_index_mean", "a loss averaged over a count of the batch: "
          "`F.cross_entropy(..., ignore_index=PAD)`, class weights, a masked mean", "differs",
          "each worker divides by its own count, as under DDP, so the update differs from one "
          "device's when the workers' counts differ; `parallax verify` names the loss (and "
          "`get_runner` an `nn.CrossEntropyLoss`/`NLLLoss` passed to it, at the first step "
          "that shows it); `parallax.global_mean` (next row) trains exactly", _ignore_index_mean,
          launched=True),
    Habit("global_mean", "`parallax.global_mean(F.cross_entropy(..., reduction='sum'), "
          "(target != PAD).sum())`", "works",
          "the workers' sums over their summed count: one device's mean, on every rank "
          "(one small all_gather a step)", _global_mean, launched=True),
    Habit("sum_loss_summed", "a loss with `reduction='sum'` and "
          "`Config(average_dense=False, average_sparse=False)`", "works",
          "gradients summed over workers", _sum_loss,
          config={"average_dense": False, "average_sparse": False}, launched=True),
    Habit("lr_per_worker", "a learning rate (or any optimizer setting) set from what one "
          "worker alone sees: `ReduceLROnPlateau.step(loss.item())` on each worker's own loss",
          "refused",
          "the replicas would drift apart and each server would update with its own rate; "
          "`all_reduce` the metric first (checked at every `optimizer.step()` of the own loop, "
          "riding in its order check, and at every `Runner.step`, riding in the push: no "
          "extra collective where a table is pushed)", None),
    Habit("ddp_program", "a DDP program (`init_process_group`, `DDP(model)`, a "
          "`DistributedSampler` loader with `set_epoch`) with `parallax.distribute(ddp_model, "
          "optimizer)` as its only change", "works",
          "parallax joins the program's process group and trains the module inside the DDP "
          "wrapper (DDP's `find_unused_parameters` kept); the wrapper is retired; the "
          "`DistributedSampler` already gives each worker its share", None),
    Habit("uneven_epoch", "an epoch whose samples the W workers do not divide "
          "(`drop_last=False`)", "differs",
          "`DistributedSampler` pads the epoch's last batch with up to W-1 repeated samples, as "
          "under DDP; `drop_last=True` or a multiple of W samples trains exactly; "
          "`parallax verify` names the step (`examples/uneven_epoch.py`)", None),
    Habit("distributed_sampler", "a DDP loader with `DistributedSampler` and "
          "`sampler.set_epoch(e)`, through `parallax.shard`", "works",
          "its shuffle, seed, padding and the epoch set by `set_epoch` are kept", None),
    Habit("random_sampler", "`DataLoader(shuffle=True)` through `parallax.shard`", "differs",
          "each epoch is a new seeded permutation (`shard(seed=...)` and the epoch), not "
          "torch's draw from the global generator; the generator still advances by the one "
          "draw the sampler takes, so later random numbers match the program's; rank 0 says so "
          "once at the start, with the exact alternative (a `DistributedSampler(dataset, "
          "num_replicas=1, rank=0, shuffle=True)` sampler and `set_epoch`)", None),
    Habit("batch_sampler", "`DataLoader(batch_sampler=BatchSampler(sampler, b, drop_last))` "
          "through `parallax.shard`", "works",
          "split as `DataLoader(sampler=sampler, batch_size=b, drop_last=drop_last)`, the same "
          "batches; a batch sampler of the program's own (bucketing by length) is refused: "
          "split it in the program, as for DDP", None),
    Habit("other_sampler", "a `WeightedRandomSampler` or custom sampler through "
          "`parallax.shard`", "refused", "its order cannot be split by index", None),
    Habit("many_runs", "several programs trained one after another in one process (a sweep, "
          "a notebook cell run again, pretraining then fine-tuning), each kept alive", "works",
          "a runner made after the current run's first step begins a new run "
          "(`parallax.runs`): its loaders, checkpoints' data positions and progress records "
          "are its own, so a later program's resume never takes an earlier one's position",
          None),
    Habit("state_dict_everywhere", "`state = model.state_dict()` on every rank, "
          "`torch.save` on rank 0", "works", "the plain single-device state dict", None),
    Habit("state_dict_rank0", "`if rank == 0: torch.save(model.state_dict(), f)` (DDP)",
          "refused", "`state_dict()` is collective (it gathers the servers' rows); every rank "
          "is stopped at once, the message says so", None),
    Habit("load_differs", "`model.load_state_dict(torch.load(f))` on every rank while rank 0 "
          "may still be writing `f`", "refused",
          "ranks loading different values would leave the replicas apart; the message names "
          "the rank and tensor and says to `dist.barrier()` after the save", None),
    Habit("inner_state_dict", "`model.module.state_dict()`", "refused",
          "the inner module holds no values of server-held parameters; use "
          "`model.state_dict()` (collective)", None),
    Habit("torch_clip_all", "`torch.nn.utils.clip_grad_norm_(model.parameters(), c)`",
          "refused", "torch would skip the servers' rows and clip by a smaller norm; use "
          "`parallax.clip_grad_norm_`", None),
    Habit("torch_clip_value_all", "`torch.nn.utils.clip_grad_value_(model.parameters(), v)`",
          "refused", "torch would skip the servers' rows; use `parallax.clip_grad_value_`",
          None),
    Habit("inner_zero_grad", "`model.module.zero_grad()`", "refused",
          "would leave the servers' rows; use `model.zero_grad()`", None),
    Habit("manual_update", "`p.data.add_(p.grad, alpha=-lr)` by hand", "refused",
          "would not reach the servers' rows; use a `torch.optim` optimizer", None),
    Habit("param_outside_model", "an optimizer that also updates a parameter outside the "
          "model (a learnable loss scale)", "refused",
          "nothing would average its gradient over the workers; register it on the model",
          None),
    Habit("new_optimizer", "an optimizer built after `distribute` over `model.parameters()`",
          "refused", "would not update the servers' rows; build it before and pass it", None),
    Habit("pickle", "`torch.save(model, f)` (or of a submodule), `pickle`, "
          "`copy.deepcopy(model)`, `AveragedModel(model)`", "refused",
          "the server-held rows are not in this process; save `model.state_dict()`", None),
    Habit("init_after", "`model.apply(init_fn)`, `nn.init.*_` or `reset_parameters()` on a "
          "server-held parameter after `distribute`", "refused",
          "would not reach the servers' rows; initialise before `distribute`, or "
          "`model.load_state_dict(...)` after", None),
    Habit("requires_grad_after", "`p.requires_grad_(False)` or `(True)` on a dense parameter "
          "after `distribute` (freezing or unfreezing mid-training)", "refused",
          "the dense synchronisation took the parameters that required gradients when it was "
          "built: an unfrozen one would be updated by each worker's own gradient, a frozen one "
          "would stall the reduction; set `requires_grad` before `distribute` (next row keeps a "
          "parameter fixed for some steps)", None),
    Habit("grad_none_fixed", "a parameter kept fixed for some steps by setting its `.grad = "
          "None` before `optimizer.step()`", "works",
          "the optimizer skips it, as on one device", _grad_none_some_steps, launched=True),
    Habit("move_after", "`model.to(...)`/`.double()` after `distribute`", "refused",
          "(a no-op when nothing changes) would leave the servers' rows; move before", None),
    Habit("compiled_model", "`model = torch.compile(model)` (or of a submodule holding a "
          "table) before `distribute`", "refused",
          "the compiled code would read the program's own module, whose tables went to "
          "parallax; pass the module before `torch.compile` (`model._orig_mod`), or compile "
          "only the submodules without tables", None),
    Habit("torch_scaler", "`torch.amp.GradScaler`", "refused",
          "would unscale and check only the replicated gradients; use `parallax.GradScaler`",
          None),
]
BY_KEY = {habit.key: habit for habit in HABITS}


def render_table(habits: Iterable[Habit] = HABITS) -> str:
    """The Markdown table of docs/habits.md and the README."""
    said = {"works": "works", "differs": "works differently", "refused": "refused"}
    lines = ["| habit | under `parallax.distribute` | how, or why |", "|---|---|---|"]
    lines += [f"| {h.habit} | {said[h.outcome]} | {h.note} |" for h in habits]
    return "\n".join(lines) + "\n"


def build(habit: Habit) -> tuple[nn.Module, torch.optim.Optimizer, dict]:
    """The model, optimizer and scheduler of ``habit``'s program (seeded: every worker and the
    single-device program build the same)."""
    torch.manual_seed(0)
    model = habit.net(habit.dropout).double()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    extra: dict[str, Any] = {}
    if habit.key == "scheduler_before":
        extra["scheduler"] = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return model, optimizer, extra


def single_device(habit: Habit) -> dict[str, torch.Tensor]:
    """The program on one device with the global batch."""
    model, optimizer, extra = build(habit)
    habit.program(Run(model, optimizer, optimizer, batches(1, 0), 1, 0, extra))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def distributed(habit: Habit, world: int, rank: int) -> dict[str, torch.Tensor]:
    """The program through `parallax.distribute` on this worker (collective)."""
    model, optimizer, extra = build(habit)
    config = parallax.Config(partition_cache=None, collective_timeout_s=60, **habit.config)
    dmodel, doptimizer = parallax.distribute(model, optimizer, config=config)
    habit.program(Run(dmodel, doptimizer, optimizer, batches(world, rank), world, rank, extra))
    return dmodel.state_dict()
