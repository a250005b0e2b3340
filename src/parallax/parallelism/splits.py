"""Which linear layers are split over a model group, and how.

Two consecutive ``nn.Linear`` layers of an ``nn.Sequential`` separated only by element-wise
activations form a pair: the first is split by output neurons and keeps its output split
(``column``), the second by input neurons (``row``): its partial products are summed by one
all-reduce. Megatron-LM's pairing, here through DTensor's ``ColwiseParallel`` /
``RowwiseParallel``. Why pairs rather than the report's output split of every layer (its
model-parallel formula ``3 Σ_l B d_l``): a pair needs one all-reduce of ``B d`` forward and
one of the pair's input backward, two collectives for two layers where gathering every
layer's outputs takes three per layer, and the activation between the layers never exists
whole. A linear layer that has no partner (odd one out, or followed by something that is not
element-wise) is split by output neurons with its output all-gathered (``gathered``): exact in
any surrounding, the report's scheme; `Config.model_split` ``"every-layer"`` splits every
layer so, the report's whole scheme, as a baseline. A layer narrower than the group, or whose
weight is shared with another module, stays whole on every process (``replicated``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:  # imported by `styles`: 0.7 s of the parallax command's start-up else
    from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["ELEMENTWISE", "LinearSplit", "Split", "plan_splits", "styles"]

#: modules that act on each value alone: a split activation passes through them unchanged
ELEMENTWISE = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.ELU,
               nn.Softplus, nn.Mish, nn.Hardtanh, nn.Identity)


class Split(StrEnum):
    COLUMN = "column"          # output neurons split, output left split for a row split
    ROW = "row"                # input neurons split, partial outputs all-reduced
    GATHERED = "gathered"      # output neurons split, outputs all-gathered
    REPLICATED = "replicated"  # whole on every process of the group


@dataclass(frozen=True)
class LinearSplit:
    """One linear layer's split: its module path, the kind and its widths."""

    path: str
    split: Split
    in_features: int
    out_features: int


def plan_splits(module: nn.Module, group_size: int, *, pairs: bool = True,
                ) -> list[LinearSplit]:
    """Every ``nn.Linear`` of ``module`` in definition order with its split for a model group
    of ``group_size`` processes (all ``replicated`` when ``group_size`` is 1). ``pairs=False``
    (`Config.model_split` ``"every-layer"``): no pairs, every wide layer ``gathered``."""
    shared = _shared_parameters(module)
    kinds: dict[str, Split] = {}
    for parent_path, parent in module.named_modules():
        if not pairs or not isinstance(parent, nn.Sequential):
            continue
        children = list(parent.named_children())
        for i, (name, child) in enumerate(children):
            path = f"{parent_path}.{name}" if parent_path else name
            if path in kinds or not _splittable(child, group_size, shared):
                continue
            if not isinstance(child, nn.Linear) or child.out_features < group_size:
                continue
            j = i + 1
            while j < len(children) and isinstance(children[j][1], ELEMENTWISE):
                j += 1
            if j < len(children):
                partner_name, partner = children[j]
                partner_path = f"{parent_path}.{partner_name}" if parent_path else partner_name
                if (_splittable(partner, group_size, shared) and partner_path not in kinds
                        and partner.in_features == child.out_features):
                    kinds[path], kinds[partner_path] = Split.COLUMN, Split.ROW
    splits = []
    for path, layer in module.named_modules():
        if not isinstance(layer, nn.Linear):
            continue
        wide = _splittable(layer, group_size, shared) and layer.out_features >= group_size
        kind = kinds.get(path) or (Split.GATHERED if wide else Split.REPLICATED)
        splits.append(LinearSplit(path, kind, layer.in_features, layer.out_features))
    return splits


def styles(splits: list[LinearSplit]) -> dict[str, ParallelStyle]:
    """DTensor's parallel style of each split layer, for ``parallelize_module``. A column
    split hands its row partner a DTensor (``use_local_output=False``): a plain local tensor
    would be re-wrapped by ``from_local``, which infers the global width as the local one
    times the group size, wrong for widths the group does not divide."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    made: dict[Split, ParallelStyle] = {
        Split.COLUMN: ColwiseParallel(use_local_output=False),
        Split.ROW: RowwiseParallel(),
        Split.GATHERED: ColwiseParallel(output_layouts=Replicate()),
    }
    return {s.path: made[s.split] for s in splits if s.split != Split.REPLICATED}


def _splittable(layer: nn.Module, group_size: int, shared: set[int]) -> bool:
    if not isinstance(layer, nn.Linear) or group_size == 1:
        return False
    if id(layer.weight) in shared or (layer.bias is not None and id(layer.bias) in shared):
        return False
    # a weight held by the servers (read by row gathers) is meta here
    return layer.weight.device.type != "meta"


def _shared_parameters(module: nn.Module) -> set[int]:
    seen: dict[int, int] = {}
    for _, param in module.named_parameters(remove_duplicate=False):
        seen[id(param)] = seen.get(id(param), 0) + 1
    return {key for key, count in seen.items() if count > 1}
