"""How the test workers end: `exit_now` after ``main()`` returned. A process that imported torch
spends about a second of the interpreter's teardown freeing modules (0.5 s for torch, 0.9 s
with torch._dynamo, which every optimizer imports), the largest part of a short launch; the
suite launches workers a few hundred times. The exit handlers still run (parallax's records
among them) and output is flushed; a worker that raises ends the normal way."""

import atexit
import os
import sys
from typing import NoReturn


def exit_now(code: int = 0) -> NoReturn:
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
