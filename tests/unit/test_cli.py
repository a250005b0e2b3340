"""The command line's words: torchrun's vocabulary with torchrun's meanings, ``--version``,
and a sub-command's usage on its own errors (in process; the launches are in
tests/integration/test_launch.py)."""

from __future__ import annotations

from importlib import metadata

import pytest

import parallax
from parallax.cli import build_parser, main


def _error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as ended:
        main(list(argv))
    assert ended.value.code == 2
    return capsys.readouterr().err


def test_version_names_parallax_torch_and_python(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ended:
        main(["--version"])
    assert ended.value.code == 0
    said = capsys.readouterr().out
    assert said.startswith(f"parallax {parallax.__version__} (torch {metadata.version('torch')}")
    assert parallax.__version__ == metadata.version("parallax-torch")  # pyproject's, one source


def test_a_sub_commands_error_prints_its_own_usage(capsys: pytest.CaptureFixture[str]) -> None:
    err = _error(capsys, "run", "--machines", "2", "train.py")
    assert err.startswith("usage: parallax run ") and "parallax run: error: --machines needs" in err


@pytest.mark.parametrize(("argv", "expected"), [
    (["--nnodes", "2", "t.py"], "--nnodes 2 needs this host's --node-rank (0..1); to emulate 2 "
                                "machines on this host use --machines 2"),
    (["--nnodes", "2", "--node-rank", "1", "t.py"], "needs the rendezvous host every node "
                                                    "reaches"),
    (["--nnodes", "2", "--node-rank", "2", "--master-addr", "h", "t.py"],
     "--node-rank 2 outside 0..1"),
    (["--nnodes", "1:4", "t.py"], "an elastic range MIN:MAX is not taken"),
    (["--standalone", "--node-rank", "1", "t.py"], "--node-rank 1 of a single node"),
    (["--standalone", "--rdzv-endpoint", "h:1", "--master-port", "2", "t.py"],
     "no --master-addr or --master-port with it"),
    (["--standalone", "--rdzv-endpoint", "h:port", "t.py"], "expected HOST or HOST:PORT"),
    (["--nnodes", "2", "--machines", "2", "t.py"], "not allowed with argument"),
    (["--nnodes", "2", "--node-rank", "0", "--master-addr", "h", "--emulate-network", "1gbit",
      "t.py"], "--emulate-network goes with --machines"),
])
def test_torchruns_words_are_checked_before_anything_starts(
        capsys: pytest.CaptureFixture[str], argv: list[str], expected: str) -> None:
    assert expected in _error(capsys, "run", *argv)


def test_torchruns_words_mean_what_they_mean_there() -> None:
    from parallax.cli import _spec_from_args

    parser = build_parser()
    args = parser.parse_args(["run", "--nnodes", "2", "--node_rank", "1", "--nproc-per-node",
                              "4", "--rdzv-endpoint", "10.0.0.1:29400", "--max_restarts", "3",
                              "-m", "pkg.train", "--lr", "0.1"])
    spec = _spec_from_args(args.command_parser, args)
    assert [m.num_workers for m in spec.machines] == [4, 4]
    assert (args.machine_index, args.master_addr, args.master_port) == (1, "10.0.0.1", 29400)
    assert (args.max_restarts, args.module, args.script, args.script_args) == (
        3, True, "pkg.train", ["--lr", "0.1"])
    args = parser.parse_args(["run", "--standalone", "train.py"])
    assert [m.num_workers for m in _spec_from_args(args.command_parser, args).machines] == [1]
    assert args.machine_index is None  # one agent, a free local port
    args = parser.parse_args(["run", "--nnodes", "3", "--node-rank", "0", "--rdzv-endpoint",
                              "[::1]", "t.py"])
    _spec_from_args(args.command_parser, args)
    assert (args.master_addr, args.master_port) == ("::1", None)
