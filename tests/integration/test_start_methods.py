"""``parallax run --start-method``: a worker forked from a process that imported torch once
(``forkserver``) runs its script as a fresh ``python -u SCRIPT`` (``exec``, the default) does.

Three launches of 1 x 2 workers (a few seconds each)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from parallax.cluster import local_spec
from parallax.errors import ArgumentError, UsageError
from parallax.launch import warm
from parallax.launch.elastic import launch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "start_probe.py"
REPO = Path(__file__).resolve().parents[2]


def _run(out: Path, mode: str, *flags: str) -> subprocess.CompletedProcess[str]:
    out.mkdir()
    cmd = [sys.executable, "-m", "parallax.cli", "run", "--machines", "1",
           "--nproc-per-machine", "2", *flags, str(SCRIPT), str(out), mode]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, warm.START_METHOD_ENV: "exec"})


def _records(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_a_forked_worker_sees_what_an_execd_one_sees_and_ends_as_it_does(tmp_path: Path):
    cold = _run(tmp_path / "exec", "ok")
    forked = _run(tmp_path / "forkserver", "ok", "--start-method", "forkserver")
    for proc in (cold, forked):
        assert proc.returncode == 0, proc.stderr[-3000:]
        # rank 1's os._exit(0) ends the job (torch elastic's function protocol would have
        # waited for its return value forever); its unflushed line was written through
        assert "rank 1 ends itself" in proc.stdout
    seen = {folder: _records(tmp_path / folder) for folder in ("exec", "forkserver")}
    for records in seen.values():
        draws = [record.pop("draws") for record in records]
        # torch's, numpy's and Python's unseeded numbers differ between ranks, as between
        # fresh interpreters (forked ones would otherwise draw the fork server's)
        assert all(a != b for a, b in zip(*draws, strict=True))
    assert seen["exec"] == seen["forkserver"]
    record = seen["forkserver"][0]
    assert record["file"] == str(SCRIPT) and record["path0"] == str(SCRIPT.parent)
    assert record["name"] == "__main__" and record["main"] and record["argv"] == ["ok"]
    assert record["threads"] == 1 and record["omp"] == "1"  # 2 workers on this 2-core host
    for folder in ("exec", "forkserver"):  # the interpreter's shutdown: threads, then atexit
        assert (tmp_path / folder / "thread").read_text() == "ran"
        assert (tmp_path / folder / "atexit").read_text() == "ran"


def test_a_forked_workers_uncaught_exception_fails_the_job_as_an_execd_ones_does(
        tmp_path: Path):
    proc = _run(tmp_path / "raise", "raise", "--start-method", "forkserver")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert ("parallax: rank 1 (machine 0) failed: exit code 1: ValueError: the probe failed "
            "on purpose") in proc.stderr
    # the traceback starts at the script, as the interpreter prints it
    traceback = proc.stderr[proc.stderr.index("Traceback"):]
    assert f'File "{SCRIPT}"' in traceback.splitlines()[1]
    assert "runpy" not in traceback.split("ValueError")[0]


def test_an_unknown_start_method_is_named_with_where_it_came_from(monkeypatch):
    monkeypatch.setenv(warm.START_METHOD_ENV, "spawn")
    with pytest.raises(ArgumentError, match="PARALLAX_START_METHOD.*'spawn'|'spawn'.*PARALLAX"):
        launch(local_spec(1, 1), ["x.py"])
    with pytest.raises(ArgumentError, match="exec, forkserver"):
        launch(local_spec(1, 1), ["x.py"], start_method="thread")


def test_the_forked_runner_understands_this_torchs_elastic_wrapper():
    assert warm.protocol_understood()
    with pytest.raises(UsageError, match="function entrypoint"):
        warm.run_script("x.py")


@pytest.mark.parametrize(("code", "status"), [(None, 0), (3, 3), (256 + 7, 7), ("bye", 1)])
def test_sys_exit_codes_become_the_interpreters_statuses(code, status, capsys):
    assert warm._exit_code(code) == status
    assert capsys.readouterr().err == ("bye\n" if code == "bye" else "")


@pytest.fixture
def interpreter_state(monkeypatch):
    """`warm._status_of` sets sys.argv and sys.path[0] as the interpreter does: restored."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "argv", list(sys.argv))


@pytest.mark.usefixtures("interpreter_state")
def test_a_module_runs_as_python_dash_m_runs_it(tmp_path, monkeypatch, capsys):
    (tmp_path / "probe_module.py").write_text("import sys\nprint(__name__, sys.argv)\n")
    monkeypatch.chdir(tmp_path)
    assert warm._status_of("-m", ("probe_module", "a")) == 0
    assert capsys.readouterr().out == f"__main__ {[str(tmp_path / 'probe_module.py'), 'a']}\n"


@pytest.mark.usefixtures("interpreter_state")
def test_a_scripts_end_is_the_interpreters(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "excepthook",
                        lambda kind, error, tb: seen.append((kind, tb.tb_frame.f_code.co_filename)))
    script = tmp_path / "fails.py"
    script.write_text("raise KeyError('k')\n")
    assert warm._status_of(str(script), ()) == 1
    assert seen == [(KeyError, str(script))]  # the hook's traceback starts at the script
    script.write_text("import sys\nsys.exit(4)\n")
    assert warm._status_of(str(script), ()) == 4
