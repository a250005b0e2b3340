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

from importlib import metadata as _metadata

from parallax.api import get_runner
from parallax.config import QSGD, Config, SlimDP
from parallax.distributed import GradScaler, clip_grad_norm_, distribute
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
from parallax.model.meta_init import meta_init
from parallax.partitions.groups import partition, partitioner
from parallax.runner import Runner
from parallax.session import shutdown

__all__ = ["ArgumentError", "ArgumentTypeError", "AsyncServerError", "CheckpointError", "Config",
           "ConfigError", "GradScaler", "InternalError", "NetemError", "NonFiniteError",
           "OptimizerError", "ParallaxError", "PlanComplete", "QSGD", "ResourceError", "Runner",
           "SlimDP", "SparseIdError", "StalledRankError", "LostRankError", "UnevenInputsError",
           "UnsupportedProgramError", "UsageError", "VerifyComplete", "clip_grad_norm_",
           "distribute", "get_runner", "meta_init", "partition", "partitioner", "shard", "shutdown"]
try:  # one source: pyproject.toml's, as installed
    __version__ = _metadata.version("parallax-torch")
except _metadata.PackageNotFoundError:  # a source tree on sys.path, never installed
    __version__ = "0+unknown"
