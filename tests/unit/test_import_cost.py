"""What ``import parallax`` costs every process (each worker, agent and launcher imports it):
the heavy parts of torch it needs only in some jobs stay out until used. DCP imports DTensor
(0.6-0.75 s per process on the 2-core host: the suite grew by minutes when
parallax.checkpoint.dcp imported it at the top)."""

from __future__ import annotations

import subprocess
import sys

#: imported where used: DCP (parallax.checkpoint.dcp), DTensor (model parallelism)
HEAVY = ("torch.distributed.checkpoint", "torch.distributed.tensor")


def test_import_parallax_leaves_dcp_and_dtensor_out() -> None:
    code = ("import sys, parallax, parallax.checkpoint; "
            f"print([m for m in {HEAVY!r} if m in sys.modules])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout
