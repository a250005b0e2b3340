"""The user's own optimizer, applied by each server to its shards of the sparse parameters.

Servers build ``type(optimizer)`` over their shards with the hyper-parameters of the param
group that held the original parameter, and copy those hyper-parameters again before every step,
so an lr scheduler (or any edit of ``param_groups``) on the user's optimizer reaches them too.
This equals the single-device update only for optimizers that act element by element, which is
why the classes are checked.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torch import nn

# torch's own sparse optimizers (Adagrad, SGD) build sparse tensors without opting in or out of
# invariant checks; the warning says nothing about the user's program.
warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled")

# Optimizers whose update of an element depends only on that element's gradient and state
# (plus per-parameter step counts, which every shard advances exactly as the whole would).
PER_SHARD_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adagrad, torch.optim.Adam, torch.optim.AdamW,
    torch.optim.SparseAdam, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
    torch.optim.RMSprop, torch.optim.Rprop, torch.optim.ASGD, torch.optim.Adadelta,
)


class OptimizerError(ValueError):
    """The optimizer cannot be reproduced on the parameter servers."""


def as_optimizer_list(optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
                      ) -> list[torch.optim.Optimizer]:
    """Accept one optimizer or several (e.g. ``SparseAdam`` for embeddings + ``Adam``)."""
    optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
    for i, opt in enumerate(optimizers):
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"optimizer[{i}] must be a torch.optim.Optimizer, "
                            f"got {type(opt).__name__}")
    return optimizers


def optimizer_of(optimizers: Sequence[torch.optim.Optimizer],
                 param: nn.Parameter) -> torch.optim.Optimizer | None:
    """The optimizer whose param groups hold ``param`` (None: it is not optimized)."""
    for opt in optimizers:
        if any(p is param for g in opt.param_groups for p in g["params"]):
            return opt
    return None


def check_per_shard(optimizers: Sequence[torch.optim.Optimizer],
                    sparse_params: dict[str, nn.Parameter]) -> None:
    """Raise `OptimizerError` naming the parameter if its optimizer cannot run per shard."""
    for name, param in sparse_params.items():
        opt = optimizer_of(optimizers, param)
        if opt is not None and not isinstance(opt, PER_SHARD_OPTIMIZERS):
            supported = ", ".join(c.__name__ for c in PER_SHARD_OPTIMIZERS)
            raise OptimizerError(
                f"optimizer {type(opt).__name__} cannot be applied per shard to the "
                f"sparse parameter '{name}': its update is not element-wise. "
                f"Supported for sparse parameters: {supported}."
            )


# Optimizers that accept sparse (COO) gradients: what `Config.lazy_sparse_updates` needs.
SPARSE_GRAD_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adagrad, torch.optim.SparseAdam)


def check_lazy(optimizers: Sequence[torch.optim.Optimizer],
               sparse_params: dict[str, nn.Parameter]) -> None:
    """Raise `OptimizerError` naming the parameter if lazy updates cannot apply to it."""
    for name, param in sparse_params.items():
        opt = optimizer_of(optimizers, param)
        if opt is not None and not isinstance(opt, SPARSE_GRAD_OPTIMIZERS):
            raise OptimizerError(
                f"Config(lazy_sparse_updates=True) gives the sparse parameter '{name}' "
                f"sparse gradients, which {type(opt).__name__} does not take; use SGD, "
                f"Adagrad or SparseAdam for it (e.g. SparseAdam for the embeddings and Adam "
                f"for the rest)."
            )


class ShardOptimizer:
    """On a server: the user's optimizer classes over this server's shards."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer],
                 shard_of: dict[int, nn.Parameter]):
        """``shard_of`` maps ``id(original sparse parameter)`` to this server's shard of it."""
        self._pairs: list[tuple[torch.optim.Optimizer, list[dict]]] = []
        for opt in optimizers:
            groups, user_groups = [], []
            for group in opt.param_groups:
                shards = [shard_of[id(p)] for p in group["params"] if id(p) in shard_of]
                if shards:
                    groups.append({**_hyper_parameters(group), "params": shards})
                    user_groups.append(group)
            if groups:
                self._pairs.append((type(opt)(groups), user_groups))

    def step(self) -> None:
        for server_opt, user_groups in self._pairs:
            for server_group, user_group in zip(server_opt.param_groups, user_groups,
                                                strict=True):
                server_group.update(_hyper_parameters(user_group))
            server_opt.step()

    def pop_shard(self, shard: nn.Parameter) -> dict:
        """Stop updating ``shard``; return its optimizer state (for moving it elsewhere)."""
        for server_opt, _ in self._pairs:
            for group in server_opt.param_groups:
                if any(p is shard for p in group["params"]):
                    group["params"] = [p for p in group["params"] if p is not shard]
                    return server_opt.state.pop(shard, {})
        return {}

    def optimizer_state(self, shard: nn.Parameter) -> dict:
        """The server optimizer's state of ``shard`` (empty before its first step)."""
        for server_opt, _ in self._pairs:
            if shard in server_opt.state:
                return dict(server_opt.state[shard])
        return {}

    def replace_shard(self, old: nn.Parameter, new: nn.Parameter, state: dict) -> None:
        """Update ``new`` (with optimizer ``state``) where ``old`` was updated: a table's shard
        after re-partitioning."""
        for server_opt, _ in self._pairs:
            for group in server_opt.param_groups:
                if any(p is old for p in group["params"]):
                    group["params"] = [new if p is old else p for p in group["params"]]
                    server_opt.state.pop(old, None)
                    if state:
                        server_opt.state[new] = state
                    return
        raise KeyError("parallax internal error: the shard to replace has no optimizer")

    def state_dicts(self) -> list[dict]:
        return [opt.state_dict() for opt, _ in self._pairs]


def _hyper_parameters(group: dict) -> dict:
    return {key: value for key, value in group.items() if key != "params"}
