"""Whether an uncaught exception is ending this process.

A worker that dies of an error must not look, to its peers, like one that ended its training
(their next step would blame uneven inputs, `parallax.engine.diagnostics.progress`), nor keep
serving asynchronous peers until they finish (`parallax.engine.asynchronous`). Python calls
``sys.excepthook`` before the ``atexit`` handlers run, so a hook that notes the failure is seen
by every end-of-process path that runs them; ``os._exit`` runs none and needs no care.
"""

from __future__ import annotations

import sys
import types

__all__ = ["failing", "watch"]

_failing = False
_watching = False


def watch() -> None:
    """Note this process's uncaught exception from now on (once per process; the hook chains
    to whichever was installed before it, and hooks installed later chain to it)."""
    global _watching
    if _watching:
        return
    _watching = True
    previous = sys.excepthook

    def note(kind: type[BaseException], value: BaseException,
             traceback: types.TracebackType | None) -> None:
        global _failing
        _failing = True
        previous(kind, value, traceback)

    sys.excepthook = note


def failing() -> bool:
    """Whether an uncaught exception is ending this process (`watch` saw it)."""
    return _failing
