"""Worker for test_launch: record current_worker() and check a gloo all_reduce.

Usage: launch_env.py OUT_DIR -- writes OUT_DIR/rank<R>.json.
"""

import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from parallax.cluster import current_worker
from parallax.launch.elastic import install_error_recorder
from parallax.launch.fast_exit import exit_now


def main() -> None:
    install_error_recorder()
    out = Path(sys.argv[1])
    worker = current_worker()
    assert worker is not None, "not launched as a distributed worker"
    (out / f"pid{worker.rank}").write_text(str(os.getpid()))
    dist.init_process_group("gloo")
    total = torch.tensor([float(worker.rank + 1)])
    dist.all_reduce(total)
    record = {
        **dataclasses.asdict(worker),
        "server_ranks": list(worker.server_ranks),
        "is_server": worker.is_server,
        "device": str(worker.device),
        "all_reduce": total.item(),
        "dist_rank": dist.get_rank(),
        "dist_world_size": dist.get_world_size(),
    }
    tmp = out / f"rank{worker.rank}.json.tmp"
    tmp.write_text(json.dumps(record))
    tmp.rename(out / f"rank{worker.rank}.json")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now()
