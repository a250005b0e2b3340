"""`Config.nonfinite`: what a step with a NaN or infinite loss or gradient does, in one place
for every sync mode. Synchronous training finds such a step on every worker at once (one
collective: `StepGradients.find_nonfinite`) and skips the whole update; asynchronous training
finds it in one worker's own push and drops that push. The choice (raise, skip and count, or
ignore) and its wording are the same.
"""

from __future__ import annotations

import logging

from parallax.errors import NonFiniteError

__all__ = ["NonFinitePolicy"]

log = logging.getLogger("parallax")


class NonFinitePolicy:
    """``action`` is `Config.nonfinite`: ``"raise"``, ``"skip"`` or ``"ignore"``."""

    def __init__(self, action: str, rank: int) -> None:
        self.action = action
        self.rank = rank
        #: steps (or, asynchronously, pushes) skipped so far
        self.skipped = 0

    @property
    def checks(self) -> bool:
        """Whether a step's loss and gradients are checked at all."""
        return self.action != "ignore"

    def applies(self, found: str, *, step: int, lost: str, skipping: str,
                warn: str | None) -> bool:
        """Whether what was checked may be applied: True when ``found`` (what is NaN or
        infinite) is empty. Otherwise raise `NonFiniteError` (``lost``: what was not applied;
        ``skipping``: what ``"skip"`` would do), or count a skip and log ``warn`` (a format
        with the step and ``found``; None: this rank stays silent) and return False."""
        if not found:
            return True
        if self.action == "raise":
            raise NonFiniteError(
                f"rank {self.rank}, step {step}: NaN or infinite {found}; {lost}. "
                f"Config(nonfinite='skip') {skipping}.")
        self.skipped += 1
        if warn is not None:
            log.warning(warn, step, found)
        return False
