"""Every error parallax raises on purpose, under one base class.

Each class also derives from the built-in exception it specialises (a bad value is still a
``ValueError``), so code written against the built-ins keeps working; all of them are exported
from `parallax`. Catch `ParallaxError` to handle any of them.
"""

from __future__ import annotations

__all__ = ["ArgumentError", "ArgumentTypeError", "AsyncServerError", "CheckpointError",
           "ConfigError", "InternalError", "NetemError", "NonFiniteError", "OptimizerError",
           "ParallaxError", "PlanComplete", "ResourceError", "SparseIdError", "StalledRankError",
           "UnevenInputsError", "UnsupportedProgramError", "UsageError", "VerifyComplete"]


class ParallaxError(Exception):
    """Base of every error parallax raises on purpose."""


class ArgumentError(ParallaxError, ValueError):
    """A parallax function got an argument value it cannot take (names the argument)."""


class ArgumentTypeError(ParallaxError, TypeError):
    """A parallax function got an argument of a type it cannot take (names the argument)."""


class UsageError(ParallaxError, RuntimeError):
    """A call at a moment it cannot be made (after `parallax.shutdown`, twice in a step, a
    state dict that does not fit)."""


class InternalError(ParallaxError, RuntimeError):
    """One of parallax's own invariants failed: a bug of ours; the message asks to report it."""


class NonFiniteError(ParallaxError, FloatingPointError, RuntimeError):
    """A step's loss or aggregated gradient is NaN or infinite under
    ``Config(nonfinite="raise")`` (names the ranks or parameters; nothing was updated), or
    `parallax.clip_grad_norm_` found a non-finite norm with ``error_if_nonfinite=True`` (a
    ``RuntimeError`` too, as torch's own raises there)."""


class ConfigError(ParallaxError, ValueError):
    """A `Config` field has a wrong value, or is unknown (names the field)."""


class ResourceError(ParallaxError, ValueError):
    """A resource file or cluster description is malformed (names the file and line)."""


class OptimizerError(ParallaxError, ValueError):
    """The user's optimizer cannot be applied per shard on the servers (names the parameter)."""


class UnsupportedProgramError(ParallaxError, ValueError):
    """The program cannot train exactly as on one device (names the parameter and option)."""


class SparseIdError(ParallaxError, IndexError):
    """A lookup id lies outside its table on some rank (names parameter, id and rank)."""


class CheckpointError(ParallaxError, RuntimeError):
    """A checkpoint cannot be written or read (names the file)."""


class NetemError(ParallaxError, RuntimeError):
    """The emulated network cannot be set up here (not root, tools missing)."""


class UnevenInputsError(ParallaxError, RuntimeError):
    """A rank called `Runner.step` after another rank ended its training."""


class StalledRankError(ParallaxError, RuntimeError):
    """A collective failed because a rank did not arrive; the message names it."""


class LostRankError(StalledRankError):
    """A collective failed because a peer's connection closed: that rank crashed or was
    killed (not a hang); the message names it and its last known step and phase."""


class AsyncServerError(ParallaxError, RuntimeError):
    """Asynchronous training (`Config.sync`): a server thread failed, or a wait for a server
    or for the slowest worker ran out of time; names the ranks involved."""


class PlanComplete(SystemExit):
    """``parallax plan``: the plan is measured and written, the workers end here.

    A `SystemExit` with status 0: a program's ``except Exception`` does not swallow it, and
    the worker ends normally, as the program ending would (no exception hook, no
    ``os._exit``). ``str()`` says where the plan went.
    """

    def __init__(self, where: str) -> None:
        super().__init__(0)
        self.where = where

    def __str__(self) -> str:
        return f"parallax plan complete: {self.where}"


class VerifyComplete(SystemExit):
    """``parallax verify``: the run recorded the steps it was asked for and ends here (a
    `SystemExit` with status 0, as `PlanComplete`)."""

    def __init__(self, steps: int) -> None:
        super().__init__(0)
        self.steps = steps

    def __str__(self) -> str:
        return f"parallax verify: {self.steps} steps recorded"
