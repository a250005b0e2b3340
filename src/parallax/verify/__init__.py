"""``parallax verify SCRIPT [ARGS]``: prove on your own program that distributed training
equals the single-process program with the global batch.

The command (`parallax.verify.command`) runs the program twice, each with `VERIFY_ENV` set:
the *reference* in one process with the global batch (a `parallax.distribute` program in
plain PyTorch, `parallax.verify.reference`; a `parallax.get_runner` program as its
one-worker run), then *distributed* on a local cluster. Both record the model's state at
every step (`parallax.verify.record`); `parallax.verify.compare` reports, per parameter, the
largest difference and the first step it went above the tolerance.
"""

from parallax.lazy import submodule_attributes
from parallax.verify.record import VERIFY_ENV, Verification, active

__all__ = ["VERIFY_ENV", "Verification", "active"]

# submodules not imported above, as attributes on first use
__getattr__ = submodule_attributes(__name__)
