"""What ``import parallax`` costs every process (each worker, agent and launcher imports it):
the heavy parts of torch it needs only in some jobs stay out until used, and the processes
that only start others (the launcher, the guard of each machine) do not import torch at all.
DCP imports DTensor (0.6-0.75 s per process on the 2-core host: the suite grew by minutes
when parallax.checkpoint.dcp imported it at the top)."""

from __future__ import annotations

import subprocess
import sys

#: imported where used: DCP (parallax.checkpoint.dcp), DTensor (model parallelism)
HEAVY = ("torch.distributed.checkpoint", "torch.distributed.tensor")


def test_import_parallax_leaves_dcp_and_dtensor_out() -> None:
    code = ("import sys, parallax, parallax.checkpoint; parallax.get_runner; "
            f"print([m for m in {HEAVY!r} if m in sys.modules])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout


def test_the_processes_that_start_others_leave_torch_out() -> None:
    """``import parallax`` loads its names on first use: the guard and the launcher's modules
    (about 2 s of CPU saved in each such process, several per launch) stay free of torch,
    while every public name still resolves, to the object its home module defines."""
    code = ("import sys, parallax, parallax.cli, parallax.launch.guard, parallax.launch.netem, "
            "parallax.launch.executors; print('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


def test_every_public_name_resolves_lazily() -> None:
    import importlib

    import parallax

    for name in parallax.__all__:
        home = importlib.import_module(parallax._HOMES[name])
        assert getattr(parallax, name) is getattr(home, name), name
    assert set(parallax.__all__) <= set(dir(parallax))
    # submodules resolve as attributes, as they did when the names were imported eagerly
    assert parallax.cluster is importlib.import_module("parallax.cluster")
    assert parallax.launch.netem is importlib.import_module("parallax.launch.netem")
    try:
        parallax.no_such_name  # noqa: B018
    except AttributeError as error:
        assert "no_such_name" in str(error)
    else:
        raise AssertionError("an unknown name must raise AttributeError")
