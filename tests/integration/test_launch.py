"""Launching workers through torch's elastic agent, failure reports and the CLI.

Each real launch costs a few seconds here (every worker imports torch), so there are three:
a local 2x2 job, a failing 2x2 job and a two-agent job through the CLI.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, ProcessFailure

from parallax.cluster import RESOURCES_ENV, free_port, local_spec, parse_resource_text
from parallax.launch import elastic as launch_mod
from parallax.launch.elastic import agent_setup, install_error_recorder, launch

# the launcher's default start (torchrun's: each worker a fresh interpreter)
pytestmark = pytest.mark.start_method("exec")

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
REPO = Path(__file__).resolve().parents[2]


def _pids(out: Path) -> dict[int, int]:
    return {int(p.name[3:]): int(p.read_text()) for p in out.glob("pid*")}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# --- planning: no processes started ---------------------------------------------------


def test_agent_setup_of_a_local_spec_runs_one_agent_for_all_machines():
    agent = agent_setup(local_spec(2, 3))
    assert (agent.nnodes, agent.node_rank, agent.nproc_per_node) == (1, 0, 6)
    assert agent.master_addr == "127.0.0.1"
    assert agent.master_port > 0


def test_agent_setup_of_a_remote_spec_needs_machine_index():
    spec = parse_resource_text("gpu-a:0,1\ngpu-b:0,1\n")
    with pytest.raises(ValueError, match="machine index"):
        agent_setup(spec)
    agent = agent_setup(spec, machine_index=1)
    assert (agent.nnodes, agent.node_rank, agent.nproc_per_node) == (2, 1, 2)
    assert (agent.master_addr, agent.master_port) == ("gpu-a", 29500)
    agent = agent_setup(spec, machine_index=0, master_addr="10.0.0.1", master_port=1234)
    assert (agent.master_addr, agent.master_port) == ("10.0.0.1", 1234)
    with pytest.raises(ValueError, match="out of range"):
        agent_setup(spec, machine_index=2)


def test_agent_setup_of_a_remote_spec_needs_equal_machines():
    spec = parse_resource_text("gpu-a:0,1\ngpu-b:0\n")
    with pytest.raises(ValueError, match="same number of workers"):
        agent_setup(spec, machine_index=0)


# --- failure reports and the error recorder -------------------------------------------


def _failure(tmp_path: Path, rank: int, exitcode: int, message: str | None) -> ProcessFailure:
    error_file = tmp_path / f"error{rank}.json"
    if message is not None:
        data = {"message": {"message": message, "extraInfo": {"timestamp": "100"}}}
        error_file.write_text(json.dumps(data))
        os.utime(error_file, (rank, rank))
    return ProcessFailure(
        local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(error_file)
    )


def test_report_puts_root_cause_first_and_summarises_stopped_ranks(tmp_path, capsys):
    spec = local_spec(2, 2)
    failures = {
        0: _failure(tmp_path, 0, -signal.SIGTERM, None),  # stopped by the agent
        3: _failure(tmp_path, 3, 1, "RuntimeError: peer closed\nmore"),  # recorded later
        2: _failure(tmp_path, 2, 7, "ValueError: root cause"),  # recorded first
        1: _failure(tmp_path, 1, -signal.SIGTERM, None),
    }
    assert launch_mod._report_failures(failures, spec) == 7
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "parallax: rank 2 (machine 1) failed: exit code 7: ValueError: root cause",
        "parallax: rank 3 (machine 1) failed: exit code 1: RuntimeError: peer closed [...]",
        "parallax: stopped rank(s) 0, 1 after the failure",
    ]


def test_report_a_killed_rank_once_and_its_peers_as_consequences(tmp_path, capsys):
    """A SIGKILLed rank is the root cause; a peer whose wait saw its connection close failed
    after it (never "stopped responding"); the status is the signal's, whatever the order."""
    lost = ("LostRankError: rank 1 is lost: its connection closed while rank 0 waited in step "
            "3 (backward) — it crashed or was killed")
    failures = {0: _failure(tmp_path, 0, 1, lost), 1: _failure(tmp_path, 1, -signal.SIGKILL, None)}
    assert launch_mod._report_failures(failures, local_spec(1, 2)) == 128 + signal.SIGKILL
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("parallax: rank 1 (machine 0) failed: exit code -9 (SIGKILL)")
    assert lines[1].startswith("parallax: rank 0 (machine 0) failed after rank 1 (machine 0) "
                               "was lost: LostRankError: rank 1 is lost")
    # seen from another machine, whose agent did not see the kill: lost, not stalled
    assert launch_mod._waited_for(0, 1, "LostRankError", local_spec(1, 2), set()) == (
        "rank 1 (machine 0) was lost (crashed or killed); rank 0 saw its connection close")
    assert "stopped responding" in launch_mod._waited_for(0, 1, "StalledRankError",
                                                          local_spec(1, 2), set())


def test_a_rank_terminated_while_failing_is_not_the_root_cause(tmp_path, capsys):
    """Both ranks raise the same error; the agent's SIGTERM reaches one after it recorded
    it: the status is the other's own (1), not 143, whichever the agent saw first."""
    error = "CheckpointError: saving step 5 failed (rank 0: No space left on device for F)"
    failures = {0: _failure(tmp_path, 0, -signal.SIGTERM, error),
                1: _failure(tmp_path, 1, 1, error)}
    os.utime(tmp_path / "error0.json", (0, 0))  # recorded first, too
    assert launch_mod._report_failures(failures, local_spec(1, 2)) == 1
    assert capsys.readouterr().err.splitlines()[0].startswith(
        "parallax: rank 1 (machine 0) failed: exit code 1: CheckpointError")


def test_report_killed_worker_without_error_file(tmp_path, capsys):
    failures = {1: _failure(tmp_path, 1, -signal.SIGKILL, None)}
    assert launch_mod._report_failures(failures, local_spec(1, 2)) == 128 + signal.SIGKILL
    err = capsys.readouterr().err
    assert "rank 1 (machine 0) failed: exit code -9 (SIGKILL): Signal 9 (SIGKILL)" in err


def test_install_error_recorder_writes_torch_error_file(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda *args: seen.append(args))
    monkeypatch.setattr(ErrorHandler, "initialize", lambda self: None)  # no faulthandler here
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    install_error_recorder()
    hook = sys.excepthook
    install_error_recorder()
    assert sys.excepthook is hook  # idempotent

    try:
        raise KeyError("missing thing")
    except KeyError as err:
        exc = err
    sys.excepthook(KeyError, exc, exc.__traceback__)

    assert seen == [(KeyError, exc, exc.__traceback__)]  # the previous hook still prints it
    data = json.loads(error_file.read_text())["message"]
    assert data["message"] == "KeyError: 'missing thing'"
    assert 'raise KeyError("missing thing")' in data["extraInfo"]["py_callstack"]
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(error_file))
    assert launch_mod._failure_summary(failure) == "KeyError: 'missing thing'"


# --- real launches ----------------------------------------------------------------------


def test_launch_local_two_machines_of_two(tmp_path, capfd):
    handler_before = signal.getsignal(signal.SIGINT)
    rc = launch(local_spec(2, 2), [str(SCRIPTS / "launch_env.py"), str(tmp_path)])
    assert rc == 0, capfd.readouterr().err

    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert [r["rank"] for r in records] == [0, 1, 2, 3]
    assert [r["dist_rank"] for r in records] == [0, 1, 2, 3]
    assert [r["machine"] for r in records] == [0, 0, 1, 1]
    assert [r["local_rank"] for r in records] == [0, 1, 0, 1]
    assert {r["world_size"] for r in records} == {4}
    assert {r["num_machines"] for r in records} == {2}
    assert [r["is_server"] for r in records] == [True, False, True, False]
    assert {tuple(r["server_ranks"]) for r in records} == {(0, 2)}
    assert {r["all_reduce"] for r in records} == {1.0 + 2 + 3 + 4}
    assert not any(_alive(pid) for pid in _pids(tmp_path).values())
    # the launcher process is left as it was
    assert RESOURCES_ENV not in os.environ
    assert "TORCHELASTIC_SIGNALS_TO_HANDLE" not in os.environ
    assert signal.getsignal(signal.SIGINT) is handler_before


def test_launch_failure_stops_all_workers_and_names_the_rank(tmp_path, capfd):
    start = time.monotonic()
    rc = launch(local_spec(2, 2), [str(SCRIPTS / "launch_fail.py"), str(tmp_path)])
    elapsed = time.monotonic() - start

    err = capfd.readouterr().err
    assert rc == 1, err
    assert elapsed < 30, err
    report = [line for line in err.splitlines() if line.startswith("parallax: ")]
    assert report[0] == (
        "parallax: rank 1 (machine 0) failed: exit code 1: RuntimeError: boom from rank 1"
    )
    assert any("3" in line for line in report[1:]), err  # the sleeping rank was stopped
    pids = _pids(tmp_path)
    assert set(pids) == {0, 1, 2, 3}
    assert [rank for rank, pid in pids.items() if _alive(pid)] == []


# --- the command line -------------------------------------------------------------------


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "parallax.cli", "run", *args]


def test_cli_malformed_resources_exit_2(tmp_path):
    resources = tmp_path / "cluster.txt"
    resources.write_text("localhost:0,1\nlocalhost:0,x\n")
    proc = subprocess.run(
        _cli("--resources", str(resources), str(SCRIPTS / "launch_env.py"), str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert f"{resources}:2: " in proc.stderr
    assert "localhost:0,x" in proc.stderr
    assert not list(tmp_path.glob("pid*"))


@pytest.mark.parametrize("words", ["ours", "torchrun's"])
def test_cli_two_agents_form_one_job(tmp_path, words):
    """One agent per machine (``--machine-index``, or torchrun's ``--nnodes``/``--node-rank``
    with ``--rdzv-endpoint``), as on a real cluster."""
    resources = tmp_path / "cluster.txt"
    resources.write_text("localhost:0,1\nlocalhost:0,1\n")
    out = tmp_path / "out"
    out.mkdir()
    port = str(free_port())

    def where(index: int) -> tuple[str, ...]:
        if words == "ours":
            return ("--resources", str(resources), "--machine-index", str(index),
                    "--master-port", port)
        return ("--nnodes", "2", "--node_rank", str(index), "--nproc-per-node", "2",
                "--rdzv-endpoint", f"127.0.0.1:{port}")

    agents = [
        subprocess.Popen(
            _cli(*where(index), str(SCRIPTS / "launch_env.py"), str(out)),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for index in (1, 0)
    ]
    try:
        outputs = [agent.communicate(timeout=120)[0] for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
    assert [agent.returncode for agent in agents] == [0, 0], outputs
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    assert [(r["machine"], r["local_rank"]) for r in records] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {r["all_reduce"] for r in records} == {10.0}


def test_cli_runs_a_module_standalone_as_torchrun_does(tmp_path):
    """``parallax run --standalone --nproc-per-node 2 -m module ARGS`` (torchrun's line)."""
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run(_cli("--standalone", "--nproc_per_node", "2", "-m", "launch_env",
                               str(out)), cwd=SCRIPTS, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              [str(REPO / "src"), os.environ.get("PYTHONPATH", "")])})
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert [(r["machine"], r["local_rank"], r["all_reduce"]) for r in records] == [
        (0, 0, 3.0), (0, 1, 3.0)]
