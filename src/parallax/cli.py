"""``parallax`` command line: ``parallax run`` starts a training script on every worker.

Examples::

    parallax run --machines 2 --nproc-per-machine 2 train.py --epochs 3
    parallax run --resources cluster.txt --machine-index 0 train.py   # on each machine
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from parallax.cluster import ResourceError, ResourceSpec, local_spec, parse_resources

__all__ = ["build_parser", "main"]

USAGE_ERROR = 2


def build_parser() -> argparse.ArgumentParser:
    """The ``parallax`` argument parser (sub-command ``run``)."""
    parser = argparse.ArgumentParser(
        prog="parallax", description="Hybrid data-parallel training for PyTorch."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = commands.add_parser(
        "run",
        help="launch a script on every worker of a cluster",
        description="Launch SCRIPT with the python running parallax on every worker.",
    )
    where = run.add_mutually_exclusive_group(required=True)
    where.add_argument("--resources", metavar="FILE", help="resource file: host[:dev,...] lines")
    where.add_argument("--machines", type=int, metavar="M", help="emulate M machines locally")
    run.add_argument(
        "--nproc-per-machine", type=int, metavar="K", help="workers per emulated machine"
    )
    run.add_argument(
        "--machine-index",
        type=int,
        metavar="I",
        help="this host's machine (line) in the resources; needed for remote hosts",
    )
    run.add_argument("--master-addr", metavar="A", help="rendezvous host")
    run.add_argument("--master-port", type=int, metavar="P", help="rendezvous port")
    run.add_argument("script", help="the training script")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the process exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    return _run(parser, args)


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``parallax run``: check the arguments cheaply, then hand over to the launcher."""
    try:
        spec = _spec_from_args(parser, args)
    except (ResourceError, OSError) as err:
        return _fail(str(err))
    if not os.path.isfile(args.script):
        return _fail(f"no such script: {args.script}")

    from parallax.launch import launch  # imports torch: keep usage errors fast

    try:
        return launch(
            spec,
            [args.script, *args.script_args],
            machine_index=args.machine_index,
            master_addr=args.master_addr,
            master_port=args.master_port,
        )
    except ValueError as err:
        return _fail(str(err))


def _spec_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ResourceSpec:
    """The resource spec from --resources, or from --machines/--nproc-per-machine."""
    if args.resources is not None:
        if args.nproc_per_machine is not None:
            parser.error("--nproc-per-machine goes with --machines, not --resources")
        return parse_resources(args.resources)
    if args.nproc_per_machine is None:
        parser.error("--machines needs --nproc-per-machine")
    if args.machines < 1 or args.nproc_per_machine < 1:
        parser.error("--machines and --nproc-per-machine must be at least 1")
    return local_spec(args.machines, args.nproc_per_machine)


def _fail(message: str) -> int:
    """Report a usage problem the way argparse does, without the usage text."""
    print(f"parallax: error: {message}", file=sys.stderr)
    return USAGE_ERROR


if __name__ == "__main__":
    sys.exit(main())
