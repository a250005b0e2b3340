"""``parallax run --max-restarts N``: torch elastic restarts of the whole worker group.

The worker script uses only torch.distributed's environment (no parallax runner): on the
first attempt rank 1 exits with status 3; on later attempts every rank records that it
finished.  With ``--collective`` the ranks also form a gloo group first, as training scripts
do, which a restart must be able to form again.  Each launch costs a few seconds here.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from parallax.cli import main
from parallax.cluster import local_spec
from parallax.launch import elastic as launch_mod

# the launcher's default start (torchrun's: each worker a fresh interpreter)
pytestmark = pytest.mark.start_method("exec")

REPO = Path(__file__).resolve().parents[2]

WORKER = '''
import os
import pathlib
import sys

rank = os.environ["RANK"]
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
out = pathlib.Path(sys.argv[1])
collective = "--collective" in sys.argv
if collective:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.ones(1)
    dist.all_reduce(total)
if attempt == "0" and rank == "1":
    os._exit(3)
if collective:
    dist.all_reduce(total)  # rank 0 of a first attempt fails here: its peer is gone
    dist.destroy_process_group()
(out / f"done-{rank}-{attempt}").write_text("ok")
'''


def _run(tmp_path: Path, *options: str, collective: bool = False) -> subprocess.CompletedProcess:
    script = tmp_path / "flaky.py"
    script.write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "parallax.cli", "run", "--machines", "1",
           "--nproc-per-machine", "2", *options, str(script), str(out)]
    if collective:
        cmd.append("--collective")
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)


def _done(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "out").iterdir())


def test_restart_recovers_a_failed_worker(tmp_path):
    proc = _run(tmp_path, "--max-restarts", "1", collective=True)
    assert proc.returncode == 0, proc.stderr
    assert _done(tmp_path) == ["done-0-1", "done-1-1"]
    assert "restarting all workers (restart 1 of 1)" in proc.stderr


def test_without_restarts_the_failure_ends_the_job(tmp_path):
    proc = _run(tmp_path, "--max-restarts", "0")
    assert proc.returncode == 3, proc.stderr
    assert "parallax: rank 1 (machine 0) failed: exit code 3" in proc.stderr
    assert "restarting" not in proc.stderr
    assert "done-1-0" not in _done(tmp_path)


def test_restarts_used_up_report_the_last_failure(tmp_path, capfd):
    """Rank 1 fails on every attempt: the job fails, with the last attempt's failure."""
    worker = tmp_path / "always.py"
    worker.write_text("import os, sys\nif os.environ['RANK'] == '1':\n    sys.exit(5)\n")
    code = main(["run", "--machines", "1", "--nproc-per-machine", "2", "--max-restarts", "1",
                 str(worker)])
    err = capfd.readouterr().err
    assert code == 5, err
    assert "restarting all workers (restart 1 of 1)" in err
    assert "parallax: the job still failed after 1 restart(s)" in err
    assert "parallax: rank 1 (machine 0) failed: exit code 5" in err


def test_max_restarts_reaches_the_launch_config(monkeypatch):
    seen = []

    def fake_elastic_launch(config, entrypoint):
        seen.append((config.max_restarts, config.rdzv_backend))
        return lambda *args: None

    monkeypatch.setattr(launch_mod, "elastic_launch", fake_elastic_launch)
    assert launch_mod.launch(local_spec(1, 2), ["x.py"]) == 0
    assert launch_mod.launch(local_spec(1, 2), ["x.py"], max_restarts=4) == 0
    assert seen == [(0, "static"), (4, launch_mod.RESTARTABLE_RDZV_BACKEND)]
    with pytest.raises(ValueError, match="max_restarts must be an int >= 0, got -1"):
        launch_mod.launch(local_spec(1, 2), ["x.py"], max_restarts=-1)


def test_cli_threads_max_restarts_to_launch(tmp_path, monkeypatch, capsys):
    script = tmp_path / "train.py"
    script.write_text("")
    calls = []
    monkeypatch.setattr(launch_mod, "launch", lambda spec, cmd, **kw: calls.append(kw) or 0)
    argv = ["run", "--machines", "1", "--nproc-per-machine", "2"]
    assert main([*argv, str(script)]) == 0
    assert main([*argv, "--max-restarts", "2", str(script), "--max-restarts", "9"]) == 0
    assert [kw["max_restarts"] for kw in calls] == [0, 2]
    assert main([*argv, "--max-restarts", "-1", str(script)]) == 2
    assert "--max-restarts must be at least 0, got -1" in capsys.readouterr().err


def test_emulated_network_passes_max_restarts_to_every_machine(tmp_path, monkeypatch):
    """``--emulate-network`` runs ``parallax run --machine-index I`` per machine: the flag must
    reach those commands (no namespaces are made here)."""
    from parallax.launch import executors, netem

    class FakeNetwork:
        def __init__(self, machines: int, rate: str) -> None:
            self.machines = machines

        def __enter__(self) -> FakeNetwork:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def address(self, machine: int) -> str:
            return f"10.0.0.{machine + 1}"

        def namespace(self, machine: int) -> str:
            return f"ns{machine}"

        def counters(self) -> list:
            return []

    commands = []
    monkeypatch.setattr(netem, "EmulatedNetwork", FakeNetwork)
    monkeypatch.setattr(executors, "launch_machines",
                        lambda spec_file, spec, cmd, execs, **kw: commands.append(cmd) or 0)
    script = tmp_path / "train.py"
    script.write_text("")
    argv = ["run", "--machines", "2", "--nproc-per-machine", "1", "--emulate-network", "1gbit"]
    assert main([*argv, "--max-restarts", "3", str(script), "a"]) == 0
    assert main([*argv, str(script), "a"]) == 0
    assert commands == [["--max-restarts", "3", str(script), "a"], [str(script), "a"]]
    # What each machine then runs parses back to the same restarts and script.
    from parallax.cli import build_parser

    args = build_parser().parse_args(["run", "--resources", "r.txt", "--machine-index", "0",
                                      "--master-addr", "10.0.0.1", "--master-port", "29400",
                                      *commands[0]])
    assert (args.max_restarts, args.script, args.script_args) == (3, str(script), ["a"])
