"""Worker for test_launch: rank 1 raises while the others are stuck.

Ranks 0 and 2 wait in a barrier (gloo may notice rank 1's exit); rank 3 sleeps, so only
the launcher's termination can end it.  Usage: launch_fail.py OUT_DIR -- each rank writes
OUT_DIR/pid<R> first.
"""

import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from parallax.cluster import current_worker
from parallax.launch import install_error_recorder

STUCK_SECONDS = 120


def main() -> None:
    install_error_recorder()
    worker = current_worker()
    assert worker is not None, "not launched as a distributed worker"
    dist.init_process_group("gloo", timeout=timedelta(seconds=STUCK_SECONDS))
    (Path(sys.argv[1]) / f"pid{worker.rank}").write_text(str(os.getpid()))
    if worker.rank == 1:
        time.sleep(0.5)  # let the others reach their waits first
        raise RuntimeError("boom from rank 1")
    if worker.rank == 3:
        time.sleep(STUCK_SECONDS)
    else:
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
