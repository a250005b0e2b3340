"""Workers forked from a process that imported torch once (``parallax run --start-method
forkserver``), each running its script as ``python -u SCRIPT ARGS`` would.

A cold worker pays ~2.3 s for ``import torch`` and ~2.2 s for ``torch._dynamo`` (which every
``torch.optim`` optimizer imports on first use) before its first line: on a host with fewer
cores than workers, most of a short job's wall time. torch elastic starts function entrypoints
through multiprocessing's forkserver; `preloaded_forkserver` has that server import torch,
``torch._dynamo`` and parallax once, and every worker is forked from it already loaded.
`run_script` then does what the interpreter does for a script (or ``-m`` module):
``sys.argv``, ``sys.path[0]``, ``__main__``, random generators seeded afresh, unbuffered
standard streams, the exception hook on an uncaught exception (exit status 1),
``SystemExit``'s status, non-daemon threads joined and ``atexit`` handlers run at the end.
What differs from a cold start: modules the server preloaded are already imported, so a
script that sets an environment variable *before* ``import torch`` to configure torch's
import (rare: torch reads most settings later) sees it ignored; standard input is
``/dev/null`` (multiprocessing's rule for its children); ``ps`` shows the fork server's
command line. Hence opt-in: ``exec`` stays the default.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import signal
import sys
import threading
from collections.abc import Iterator

from parallax.errors import UsageError

__all__ = ["PRELOAD", "START_METHODS", "START_METHOD_ENV", "preloaded_forkserver",
           "run_script"]

#: What the fork server imports once for every worker it forks.
PRELOAD = ("torch", "torch._dynamo", "parallax", "parallax.distributed")
#: ``exec``: each worker a fresh ``python -u SCRIPT`` (torchrun's way, the default);
#: ``forkserver``: forked from a server that imported `PRELOAD` (see the module docstring).
START_METHODS = ("exec", "forkserver")
#: The local of torch elastic's worker wrapper (``api._wrap``) holding its return queue.
_RETURN_QUEUE = "ret_val_"
#: The default start method of `parallax.launch.elastic.launch` and ``parallax run``.
START_METHOD_ENV = "PARALLAX_START_METHOD"


@contextlib.contextmanager
def preloaded_forkserver() -> Iterator[None]:
    """Within: multiprocessing's fork server (started on first use) preloads `PRELOAD`.

    On leaving, the server is stopped, so that the next launch in this process starts one with
    the environment it sets (a server's children inherit the environment it started with)."""
    multiprocessing.set_forkserver_preload(list(PRELOAD))
    try:
        yield
    finally:
        multiprocessing.set_forkserver_preload([])
        server = multiprocessing.forkserver._forkserver
        stop = getattr(server, "_stop", None)
        if stop is not None:
            stop()


def run_script(target: str, *args: str) -> None:
    """Run ``python -u TARGET ARGS`` (``TARGET`` ``-m MODULE`` as two arguments: see
    `script_arguments`) in this process, as the interpreter would, and end it the same way.

    Returns (exit status 0: torch elastic's function protocol then collects the worker) only
    when the script ended without error; any other status ends the process with ``os._exit``
    after the same shutdown an interpreter does."""
    _counted_done_now()
    _fresh_random_states()
    _unbuffered_streams()
    status = _status_of(target, args)
    _interpreter_shutdown()
    if status != 0:
        os._exit(status)


def protocol_understood() -> bool:
    """Whether torch elastic's worker wrapper is the one `_counted_done_now` reads."""
    from torch.distributed.elastic.multiprocessing import api

    return _RETURN_QUEUE in api._wrap.__code__.co_varnames


def _counted_done_now() -> None:
    """Put this worker's return value now, before the script runs.

    torch elastic's agent counts a function worker done once it has put its return value,
    and waits for every one: a script that ends its own process (``os._exit(0)``, as fast
    exits do) would leave it waiting forever. Counted from the start, a worker's end is its
    exit status, as for an exec'd worker (a non-zero one still fails the job)."""
    from torch.distributed.elastic.multiprocessing import api

    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not api._wrap.__code__:
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        raise UsageError("parallax.launch.warm.run_script runs only as torch elastic's "
                         "function entrypoint (start_method='forkserver')")
    frame.f_locals[_RETURN_QUEUE].put(None)


def _status_of(target: str, args: tuple[str, ...]) -> int:
    """Run the script; the exit status a cold interpreter would end with."""
    try:
        if target == "-m":
            module, *rest = args
            sys.argv = [module, *rest]  # runpy sets argv[0] to the module's file
            sys.path[0] = os.getcwd()
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [target, *args]
            sys.path[0] = os.path.dirname(os.path.realpath(target))
            runpy.run_path(os.path.abspath(target), run_name="__main__")  # __file__ absolute
    except SystemExit as done:
        return _exit_code(done.code)
    except KeyboardInterrupt as interrupted:
        _uncaught(interrupted)
        _interpreter_shutdown()
        # as the interpreter: end by SIGINT itself, so the parent sees the signal
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        return 130
    except BaseException as error:
        _uncaught(error)
        return 1
    return 0


def _uncaught(error: BaseException) -> None:
    """Hand ``error`` to ``sys.excepthook`` as the interpreter would: its traceback starting
    at the script (without this module's and runpy's frames)."""
    tb = error.__traceback__
    while tb is not None and (tb.tb_frame.f_code.co_filename == __file__
                              or tb.tb_frame.f_code.co_filename.startswith("<frozen runpy")):
        tb = tb.tb_next
    sys.excepthook(type(error), error.with_traceback(tb), tb)


def _exit_code(code: object) -> int:
    """``sys.exit(code)``'s status: None is 0, an int itself, anything else printed, 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _fresh_random_states() -> None:
    """Seed the generators a fresh interpreter seeds from the operating system's entropy:
    torch's CPU generator and numpy's global one (Python's ``random`` reseeds itself after a
    fork). Forked, every worker would otherwise draw the fork server's numbers: the same
    unseeded dropout masks and shuffles on every rank, where exec'd workers draw their own."""
    import torch

    torch.default_generator.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _unbuffered_streams() -> None:
    """``python -u``: standard output and error written through at once (a worker's lines
    reach the launcher as they are printed, and none are lost at ``os._exit``)."""
    for name, fd in (("stdout", 1), ("stderr", 2)):
        old = getattr(sys, name)
        encoding = getattr(old, "encoding", None) or "utf-8"
        errors = getattr(old, "errors", None) or "strict"
        with contextlib.suppress(OSError):
            old.flush()
        stream = io.TextIOWrapper(io.FileIO(fd, "w", closefd=False),
                                  encoding=encoding, errors=errors, write_through=True)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _interpreter_shutdown() -> None:
    """What the interpreter does after ``__main__`` ends: join non-daemon threads, run the
    ``atexit`` handlers, flush the standard streams."""
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
