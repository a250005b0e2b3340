"""Worker for test_launch: rank 1 raises while the others are stuck.

Ranks 0 and 2 wait in a barrier (gloo may notice rank 1's exit); rank 3 sleeps, so only
the launcher's termination can end it.  Usage: launch_fail.py OUT_DIR -- each rank writes
OUT_DIR/pid<R> first; rank 1 raises once all have.
"""

import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from parallax.cluster import current_worker
from parallax.launch.elastic import install_error_recorder
from parallax.launch.fast_exit import exit_now

STUCK_SECONDS = 120


def _wait_for_pids(out: Path, world_size: int) -> None:
    """Fail only once every rank has written its PID (and is about to wait)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if all((out / f"pid{rank}").exists() for rank in range(world_size)):
            time.sleep(0.2)
            return
        time.sleep(0.05)


def main() -> None:
    install_error_recorder()
    worker = current_worker()
    assert worker is not None, "not launched as a distributed worker"
    dist.init_process_group("gloo", timeout=timedelta(seconds=STUCK_SECONDS))
    out = Path(sys.argv[1])
    (out / f"pid{worker.rank}").write_text(str(os.getpid()))
    if worker.rank == 1:
        _wait_for_pids(out, worker.world_size)
        raise RuntimeError("boom from rank 1")
    if worker.rank == 3:
        time.sleep(STUCK_SECONDS)
    else:
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now()
