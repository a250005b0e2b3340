"""Worker for test_start_methods: what the interpreter gave this script, and how it ends.

Usage: start_probe.py OUT_DIR MODE -- writes OUT_DIR/rank<R>.json; MODE ``ok``: rank 1 ends
its process itself (``os._exit(0)``), rank 0 returns, leaving a non-daemon thread and an
``atexit`` handler that each write a file; MODE ``raise``: rank 1 raises, rank 0 waits to be
stopped.
"""

import atexit
import json
import os
import random
import sys
import threading
import time
from pathlib import Path

import numpy
import torch

from parallax.launch.elastic import install_error_recorder


def main() -> None:
    install_error_recorder()
    out, mode = Path(sys.argv[1]), sys.argv[2]
    rank = int(os.environ["RANK"])
    record = {
        "argv": sys.argv[2:], "argv0": os.path.basename(sys.argv[0]), "name": __name__,
        "file": __file__, "path0": sys.path[0], "rank": rank,
        "world": os.environ["WORLD_SIZE"], "omp": os.environ.get("OMP_NUM_THREADS"),
        "threads": torch.get_num_threads(), "main": sys.modules["__main__"].__dict__ is globals(),
        "write_through": sys.stdout.write_through,
        # unseeded draws: each rank's own (seeded from the system's entropy at start)
        "draws": [torch.rand(1).item(), float(numpy.random.rand()), random.random()],
    }
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    if mode == "raise":
        if rank == 1:
            raise ValueError("the probe failed on purpose")
        time.sleep(60)
    if rank == 1:
        sys.stdout.write("rank 1 ends itself\n")  # no flush: -u must have written it
        os._exit(0)
    atexit.register(lambda: (out / "atexit").write_text("ran"))
    threading.Thread(target=lambda: (time.sleep(0.3), (out / "thread").write_text("ran"))).start()


if __name__ == "__main__":
    main()
