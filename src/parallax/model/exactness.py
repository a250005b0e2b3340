"""Programs parallax cannot train exactly are refused at `get_runner`, never trained silently
different.

The batch-dependent embedding options (``max_norm``, ``scale_grad_by_freq``) are exact on
sparse tables, whose servers (or replicas) see the ids of the whole global batch. A parameter
read with them that is *not* a sparse table (a weight tied to an output projection, a table
also read densely, a frozen table with ``max_norm``) would be replicated by DDP, and every
worker would apply the option to its own part of the batch: frequencies counted per worker,
rows renormalised only where this worker looked — replicas that drift apart. Those programs
are refused here, with the parameter, where it is read and the option.

What trains differently on several workers, as under DDP, is said once at the start
(`warn_per_worker_statistics`): a BatchNorm layer normalises each worker's batch by that
batch's own statistics, not the global batch's. So is a loss module passed to `get_runner`
that averages over a count the workers do not share (`PerWorkerMean`).

A parameter frozen or unfrozen after `get_runner` (``requires_grad_`` on a dense parameter) is
refused at the next training forward (`RequiresGradWatch`): the dense synchronisation took the
parameters that required gradients when it was built, so an unfrozen one would be updated by
each worker's own gradient (replicas drifting apart, silently) and a frozen one would stall
DDP's reduction.

A module compiled by ``torch.compile`` (an ``OptimizedModule``) that holds a parameter parallax
takes over (a sparse table, or a parameter on the servers) is refused too
(`check_not_compiled`): its compiled code reads the program's own module, whose taken
parameters no longer hold their rows, so it would fail (a device mismatch inside dynamo) or
read stale values; a compiled submodule that holds only DDP's replicated parameters (an MLP
beside the tables) runs as it is.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

import torch
from torch import Tensor, nn

from parallax.config import Config
from parallax.engine.tables.lookup_options import check_batch_dependent
from parallax.errors import UnsupportedProgramError
from parallax.logs import log
from parallax.model.detect import SparseUse, batch_dependent_reads

__all__ = ["check_exact", "check_not_compiled", "warn_per_worker_statistics"]


def check_exact(model: nn.Module, sparse_uses: dict[str, SparseUse], config: Config) -> None:
    """Raise `UnsupportedProgramError` (a ``ValueError``) for the first parameter of
    ``model`` whose training could not equal the single-device program's (see the module
    docstring). Runs in every worker and, for a self-launching script, in the launching
    process before any worker starts."""
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, (where, options) in batch_dependent_reads(model).items():
        if name in sparse_uses:
            continue
        if not params[name].requires_grad and options.max_norm is None:
            continue  # scale_grad_by_freq on a frozen table changes nothing
        why = ("it is frozen (requires_grad=False), so it stays a plain replica on every "
               "worker" if not params[name].requires_grad else
               "it is also read outside its lookups (tied or re-used), so it is dense and "
               "replicated by DDP")
        described = options.describe() or "max_norm/scale_grad_by_freq computed in forward"
        raise UnsupportedProgramError(
            f"parameter '{name}' is looked up with {described} ({where}), but {why}: "
            "each worker would apply that to its own part of the batch instead of the "
            "global batch, and training would silently differ "
            "from one device. Untie the weight or drop the option; on a parameter read only "
            "by its embedding lookups parallax applies it exactly.")
    for name, use in sparse_uses.items():
        dependent = use.batch_dependent
        if dependent is not None and dependent.scale_grad_by_freq and (
                use.sparse_grad or config.lazy_sparse_updates):
            check_batch_dependent(name, dependent, sparse_grad=True)
        if (dependent is not None and dependent.scale_grad_by_freq
                and use.kind == "embedding_bag"):
            raise UnsupportedProgramError(
                f"parameter '{name}': nn.EmbeddingBag(scale_grad_by_freq=True) at "
                f"'{use.module_path}' has no single-device result to be equal to: torch 2.13's "
                "CPU kernel divides rows by the count of another id (pytorch/pytorch#190063, "
                "fixed after 2.13) and refuses mode='max'. Use nn.Embedding with "
                "scale_grad_by_freq and pool it yourself, or drop the option.")


def check_not_compiled(model: nn.Module, taken: Iterable[str], rank: int | None = None) -> None:
    """Raise `UnsupportedProgramError` if a ``torch.compile``'d module of ``model`` (the model
    itself or a submodule) holds one of the ``taken`` parameters (its sparse tables and the
    servers' parameters; see the module docstring), naming the module, the parameter and
    what to compile instead (and ``rank``, in a worker)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None:  # nothing was compiled in this process
        return
    held = set(taken)
    for path, module in model.named_modules(remove_duplicate=False):
        if not isinstance(module, eval_frame.OptimizedModule):
            continue
        prefix = f"{path}." if path else ""
        inside = [f"{prefix}{name}" for name, _ in module.named_parameters(
            remove_duplicate=False) if f"{prefix}{name}" in held]
        if inside:
            what = "the model itself is" if not path else f"module {path!r} is"
            where = "" if rank is None else f"rank {rank}: "
            raise UnsupportedProgramError(
                f"{where}{what} compiled by torch.compile and holds parameter {inside[0]!r}, which "
                f"parallax takes over (an embedding table, or a parameter on its servers): "
                f"the compiled code would read the program's own copy, which no longer holds "
                f"its rows. Pass the module before "
                f"torch.compile (a compiled module's original is its ._orig_mod), or compile "
                f"only submodules without embedding tables (e.g. the MLP beside them): those "
                f"run compiled as they are.")


def warn_per_worker_statistics(model: nn.Module, world_size: int) -> list[str]:
    """Log (once, where called: rank 0) each BatchNorm layer of ``model``: on ``world_size``
    > 1 workers it normalises by each worker's batch, as under DDP, so training differs from
    one device's. Returns the modules' names."""
    if world_size == 1:
        return []
    names = [name or "the model" for name, module in model.named_modules()
             if isinstance(module, nn.modules.batchnorm._BatchNorm)]
    if names:
        log.warning(
            f"parallax: {', '.join(repr(n) for n in names[:3])}"
            f"{f' and {len(names) - 3} more' if len(names) > 3 else ''} "
            f"{'is a BatchNorm layer' if len(names) == 1 else 'are BatchNorm layers'}: in "
            f"training mode each of the {world_size} workers normalises its own batch by that "
            f"batch's statistics (running statistics from rank 0), as under DDP, so training "
            f"differs from one device with the global batch (nn.SyncBatchNorm, on GPUs, "
            f"normalises by the global batch's statistics; parallax verify shows the "
            f"difference)")
    return names


class PerWorkerMean:
    """Says once, on the rank that sees it, that ``loss_fn`` (an ``nn.CrossEntropyLoss`` or
    ``nn.NLLLoss`` with the mean reduction, `get_runner`'s loss) divides each worker's loss by
    that worker's own count: the class weights of its targets, or its targets not ignored
    (``ignore_index`` among them). Averaged over workers, as under DDP, that is one device's
    mean only when every worker counted the same; `parallax.global_mean` is exact. The targets
    are looked at in the first `STEPS` steps (a padded batch is seldom later than that)."""

    STEPS = 10

    def __init__(self, loss_fn: object, world_size: int) -> None:
        self.loss: nn.CrossEntropyLoss | nn.NLLLoss | None = (
            loss_fn if isinstance(loss_fn, (nn.CrossEntropyLoss, nn.NLLLoss)) and world_size > 1
            and loss_fn.reduction == "mean" else None)
        self.steps = 0

    def check(self, targets: object) -> bool:
        """Look at a step's ``targets``; returns whether it said so now."""
        loss = self.loss
        if loss is None or not isinstance(targets, Tensor) or targets.is_floating_point():
            return False  # soft labels divide by the batch's size, the same on every worker
        self.steps += 1
        weighted = loss.weight is not None
        if weighted or bool((targets == loss.ignore_index).any()):
            self.loss = None
            kind = type(loss).__name__
            log.warning(
                f"parallax: the loss {kind}(reduction='mean') divides each worker's loss by "
                + ("the class weights of that worker's targets" if weighted else
                   f"that worker's targets not ignored (ignore_index={loss.ignore_index} is "
                   f"among them)")
                + ": averaged over the workers, as under DDP, that is not one device's mean of "
                "the global batch; for that, pass a loss_fn that sums and divides by the "
                f"global count: parallax.global_mean({kind}(reduction='sum', ...)(output, "
                "target), count)")
            return True
        if self.steps >= self.STEPS:
            self.loss = None
        return False


class RequiresGradWatch:
    """Which of ``params`` required gradients when the run was built; `check` refuses a
    training forward after any of them changed (see the module docstring)."""

    def __init__(self, params: dict[str, nn.Parameter], rank: int) -> None:
        self.params = list(params.items())
        self.wanted = [p.requires_grad for _, p in self.params]
        self.rank = rank

    def check(self, step: int) -> None:
        """Before a training forward of ``step``: raise naming what changed, if anything."""
        # (a server-held parameter's handle answers as itself: no torch function per read)
        with torch._C.DisableTorchFunctionSubclass():
            now = [p.requires_grad for _, p in self.params]
        if now == self.wanted:
            return
        changed = [(name, p.requires_grad) for (name, p), was in zip(self.params, self.wanted,
                                                                   strict=True)
                   if p.requires_grad != was]
        said = ", ".join(f"{name!r} ({'unfrozen' if now else 'frozen'})" for name, now in changed)
        raise UnsupportedProgramError(
            f"rank {self.rank}: parameter(s) {said} changed requires_grad after "
            f"parallax.distribute/get_runner (seen before the forward of step {step}): the "
            "dense synchronisation took the parameters that required gradients when it was "
            "built, so an unfrozen parameter would be updated by each worker's own gradient "
            "and a frozen one would stall the others' reduction. Fix: set requires_grad before "
            "parallax.distribute to what training needs; to keep a parameter fixed in some "
            "steps, leave requires_grad=True and set its .grad = None before optimizer.step() "
            "in those steps (the optimizer then skips it, as it skips a frozen one)")
