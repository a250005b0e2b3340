"""Parallax for PyTorch: sparsity-aware hybrid data-parallel training.

Dense parameters are replicated and AllReduced (DDP); sparse parameters (embedding tables and
other row-gathered weights) are row-partitioned on parameter servers. The whole user surface:

    loader = parallax.shard(loader)
    runner = parallax.get_runner(model, optimizer, loss_fn, resources="resources.txt",
                                 config=parallax.Config(clip_grad_norm=10.0))
    for batch in loader:
        loss = runner.step(batch)
    state = runner.state_dict()   # plain single-device state_dict

Tables created inside ``with parallax.partitioner():`` (or passed to `parallax.partition`) get
their partition count searched in process during the first steps after the warm-up.
"""

# The names load on first use (PEP 562), so that processes which only start, guard or
# launch others (``python -m parallax.launch.guard``, ``parallax run``'s launcher) do not pay
# for importing torch (about 2 s of CPU each, several per launch).
import importlib as _importlib
from importlib import metadata as _metadata
from typing import TYPE_CHECKING

from parallax.lazy import submodule_attributes as _submodule_attributes

if TYPE_CHECKING:
    from parallax.api import get_runner
    from parallax.config import QSGD, Config, SlimDP
    from parallax.distributed import GradScaler, clip_grad_norm_, clip_grad_value_, distribute
    from parallax.errors import (
        ArgumentError,
        ArgumentTypeError,
        AsyncServerError,
        CheckpointError,
        ConfigError,
        InternalError,
        LostRankError,
        NetemError,
        NonFiniteError,
        OptimizerError,
        ParallaxError,
        PlanComplete,
        ResourceError,
        SparseIdError,
        StalledRankError,
        UnevenInputsError,
        UnsupportedProgramError,
        UsageError,
        VerifyComplete,
    )
    from parallax.loader import shard
    from parallax.losses import global_mean
    from parallax.model.meta_init import meta_init
    from parallax.partitions.groups import partition, partitioner
    from parallax.runner import Runner
    from parallax.session import shutdown

# public name -> the module that defines it
_HOMES = {
    "get_runner": "parallax.api",
    **dict.fromkeys(("QSGD", "Config", "SlimDP"), "parallax.config"),
    **dict.fromkeys(("GradScaler", "clip_grad_norm_", "clip_grad_value_", "distribute"),
                    "parallax.distributed"),
    **dict.fromkeys(("ArgumentError", "ArgumentTypeError", "AsyncServerError", "CheckpointError",
                     "ConfigError", "InternalError", "LostRankError", "NetemError",
                     "NonFiniteError", "OptimizerError", "ParallaxError", "PlanComplete",
                     "ResourceError", "SparseIdError", "StalledRankError", "UnevenInputsError",
                     "UnsupportedProgramError", "UsageError", "VerifyComplete"),
                    "parallax.errors"),
    "shard": "parallax.loader",
    "global_mean": "parallax.losses",
    "meta_init": "parallax.model.meta_init",
    **dict.fromkeys(("partition", "partitioner"), "parallax.partitions.groups"),
    "Runner": "parallax.runner",
    "shutdown": "parallax.session",
}

__all__ = ["ArgumentError", "ArgumentTypeError", "AsyncServerError", "CheckpointError", "Config",
           "ConfigError", "GradScaler", "InternalError", "NetemError", "NonFiniteError",
           "OptimizerError", "ParallaxError", "PlanComplete", "QSGD", "ResourceError", "Runner",
           "SlimDP", "SparseIdError", "StalledRankError", "LostRankError", "UnevenInputsError",
           "UnsupportedProgramError", "UsageError", "VerifyComplete", "clip_grad_norm_",
           "clip_grad_value_", "distribute", "get_runner", "global_mean", "meta_init",
           "partition", "partitioner", "shard", "shutdown"]
try:  # one source: pyproject.toml's, as installed
    __version__ = _metadata.version("parallax-torch")
except _metadata.PackageNotFoundError:  # a source tree on sys.path, never installed
    __version__ = "0+unknown"

_submodule = _submodule_attributes(__name__)


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    # a submodule otherwise (``parallax.cluster``), as when these names were imported eagerly
    value = (getattr(_importlib.import_module(home), name) if home is not None
             else _submodule(name))
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
