"""Whether an uncaught exception is ending this process.

A worker that dies of an error must not look, to its peers, like one that ended its training
(their next step would blame uneven inputs, `parallax.engine.diagnostics.progress`), nor keep
serving asynchronous peers until they finish (`parallax.engine.asynchronous`). Python calls
``sys.excepthook`` before the ``atexit`` handlers run, so a hook that notes the failure is seen
by every end-of-process path that runs them; ``os._exit`` runs none and needs no care. The
same hook explains a torch error that parallax knows (`explained`) after its traceback.
"""

from __future__ import annotations

import sys
import types

__all__ = ["explained", "failing", "watch"]

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
        said = explained(value)
        if said is not None:
            print(f"parallax: the error above, in parallax's terms: {said}", file=sys.stderr)

    sys.excepthook = note


def explained(error: BaseException) -> str | None:
    """``error`` in parallax's terms, by the current run's runners (`parallax.runs`; their
    `parallax.step.torch_errors`): DDP's error raised in the own loop's ``loss.backward()``,
    where no parallax call can catch it, explained after its traceback. None: not one we
    know."""
    from parallax import runs

    run = runs.current_run()
    for runner in run.runners() if run is not None else []:
        parallax_error = runner.explain_error(error)
        if parallax_error is not None:
            return str(parallax_error)
    return None


def failing() -> bool:
    """Whether an uncaught exception is ending this process (`watch` saw it)."""
    return _failing
