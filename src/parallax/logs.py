"""parallax's own messages: the ``logging`` logger ``"parallax"``.

What a run says of itself (a resume, a partition count chosen, a grid chosen, a checkpoint
skipped, a worker's warning) goes to this logger, never to ``print``. Unless the program
configured logging itself (handlers on ``"parallax"`` or on the root logger), `configure`
gives it one handler on standard error: rank 0 says what it does (``INFO``), the other ranks
only what goes wrong (``WARNING``), so that W workers do not print W copies of each line;
``PARALLAX_LOG_ALL_RANKS=1`` lets every rank say everything. The command line's own reports
(the launcher's failure summary, ``parallax plan``'s table) stay plain output: they are the
commands' results, not a library's chatter.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["ALL_RANKS_ENV", "configure", "log"]

log = logging.getLogger("parallax")
ALL_RANKS_ENV = "PARALLAX_LOG_ALL_RANKS"
_ours: logging.Handler | None = None


def configure(rank: int) -> None:
    """Give ``"parallax"`` its default handler and this rank's level (once per process; a
    program that configured logging keeps its own)."""
    global _ours
    if _ours is not None or log.handlers or logging.getLogger().handlers:
        return
    _ours = logging.StreamHandler(sys.stderr)
    _ours.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(_ours)
    log.propagate = False
    everyone = os.environ.get(ALL_RANKS_ENV, "") not in ("", "0")
    log.setLevel(logging.INFO if rank == 0 or everyone else logging.WARNING)
