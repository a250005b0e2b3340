"""Ending one of our own processes at once: the ``parallax`` command, and the benchmark and
test workers, once their work is done.

A process that imported torch spends up to a second in the interpreter's teardown freeing
modules (0.5 s for torch, 0.9 s once torch._dynamo is loaded, which every optimizer does),
the largest part of a short launch. `exit_now` runs the exit handlers (parallax's progress
records, weakref finalizers such as temporary folders' clean-up, logging), flushes the
output and ends the process. Not for a user's program: objects a program leaves open (a
file not closed) are only flushed by that teardown.
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import NoReturn

__all__ = ["exit_now"]


def exit_now(code: int = 0) -> NoReturn:
    """End this process with ``code`` after its exit handlers, skipping the teardown."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
