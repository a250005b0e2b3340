"""``parallax`` command line.

``parallax run`` starts a training script on every worker; ``parallax plan`` runs it only for
the warm-up steps that measure sparsity (and, for tables in a `parallax.partitioner`, the
partition-count search), then prints the per-parameter plan (and writes it as JSON) and stops.
``parallax export`` turns a sharded checkpoint into one plain state_dict file; ``parallax
manifest`` prints a Kubernetes PyTorchJob; ``parallax verify`` compares a program's
distributed training with its one-process run, step by step.

``parallax run`` also takes torchrun's vocabulary with torchrun's meanings (``--nnodes``,
``--nproc-per-node``, ``--node-rank``, ``--master-addr``/``--master-port`` or
``--rdzv-endpoint``, ``--standalone``, ``-m``/``--module``, ``--max-restarts``; dashes or
underscores), so a torchrun command line runs as it is with ``torchrun`` replaced by
``parallax run``.

Examples:

    parallax run --machines 2 --nproc-per-machine 2 train.py --epochs 3
    parallax run --standalone --nproc-per-node 4 train.py   # torchrun's words
    parallax run --nnodes 2 --node-rank 0 --nproc-per-node 4 --rdzv-endpoint 10.0.0.1:29500 \
        -m mypkg.train                                        # on each host, its rank
    parallax run --resources cluster.txt train.py       # every host: here, the others over ssh
    parallax run --resources cluster.txt --machine-index 0 train.py   # one host, by hand
    srun --ntasks-per-node=1 parallax run --slurm --nproc-per-machine 4 train.py
    parallax manifest --name lm --image registry/lm:1 --nodes 4 train.py > job.json
    parallax run --machines 1 --nproc-per-machine 4 --max-restarts 3 train.py
    parallax plan --machines 2 --nproc-per-machine 2 --json plan.json train.py
    parallax export checkpoints/ model.pt    # the newest complete step under checkpoints/
    parallax verify --steps 20 train.py --lr 0.1   # distributed == one process, per parameter
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Sequence
from typing import NoReturn, TypeAlias

from parallax.cluster import (
    PLAN_ONLY_ENV,
    PLAN_WARMUP_ENV,
    ResourceError,
    ResourceSpec,
    local_spec,
    parse_resources,
)
from parallax.launch.fast_exit import exit_now
from parallax.launch.warm import START_METHOD_ENV, START_METHODS

__all__ = ["build_parser", "entry", "main"]

USAGE_ERROR = 2


def build_parser() -> argparse.ArgumentParser:
    """The ``parallax`` argument parser (sub-commands ``run``, ``plan``, ``export``,
    ``verify`` and ``manifest``; each sub-command's parser is its namespace's
    ``command_parser``, so that its usage errors print its own usage)."""
    parser = argparse.ArgumentParser(
        prog="parallax", description="Hybrid data-parallel training for PyTorch."
    )
    parser.add_argument("--version", action="version", version=version_text())
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_run, _add_plan, _add_export, _add_verify, _add_manifest):
        add(commands)
    for command in commands.choices.values():
        command.set_defaults(command_parser=command)
    return parser


def version_text() -> str:
    """``parallax X (torch Y, Python Z)``, from the installed packages' metadata (no torch
    import: ``--version`` answers at once)."""
    from importlib import metadata

    import parallax

    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "not installed"
    python = ".".join(map(str, sys.version_info[:3]))
    return f"parallax {parallax.__version__} (torch {torch_version}, Python {python})"


Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def _add_run(commands: Commands) -> None:
    run = commands.add_parser(
        "run",
        help="launch a script on every worker of a cluster",
        description="Launch SCRIPT with the python running parallax on every worker.",
    )
    run.add_argument(
        "--max-restarts", "--max_restarts",
        dest="max_restarts",
        type=int,
        default=0,
        metavar="N",
        help="when a worker fails, restart all workers up to N times before giving up "
        "(torch elastic restarts; the script must resume itself, e.g. from a checkpoint; "
        "default 0)",
    )
    run.add_argument(
        "--timeline",
        metavar="FILE",
        help="write a Chrome trace (chrome://tracing, ui.perfetto.dev) of every step's phases "
        "to FILE: one process per rank, one track per phase; rank 0 writes it, with every "
        "rank's phases (under torchrun: PARALLAX_TIMELINE=FILE)",
    )
    _add_cluster_arguments(run)


def _add_plan(commands: Commands) -> None:
    plan = commands.add_parser(
        "plan",
        help="measure sparsity (and search partition counts), print the plan, stop",
        description="Run SCRIPT on every worker for the warm-up steps, and the partition-count "
        "search of tables created in a parallax.partitioner (unless cached); print the "
        "per-parameter plan (alpha, placement, partitions, predicted bytes per architecture) "
        "and how each partition count was chosen.",
    )
    plan.add_argument("--json", metavar="FILE", default="", help="also write the plan here")
    plan.add_argument("--warmup-steps", type=int, default=5, metavar="K",
                      help="training steps that measure alpha (default 5)")
    _add_cluster_arguments(plan)


def _add_export(commands: Commands) -> None:
    export = commands.add_parser(
        "export",
        help="write a sharded checkpoint's model as one plain state_dict file",
        description="Assemble CHECKPOINT (a step directory, or a checkpoint root whose newest "
        "complete step is used) into a single-device state_dict and torch.save it to OUT; "
        "every file read is checked against the manifest's checksums.",
    )
    export.add_argument("checkpoint", metavar="CHECKPOINT", help="step directory or root")
    export.add_argument("out", metavar="OUT", help="the .pt file to write (with --format dcp: "
                        "the folder)")
    export.add_argument("--format", choices=["torch", "dcp"], default="torch",
                        help="torch: one file, model.load_state_dict(torch.load(OUT)); dcp: a "
                        "torch.distributed.checkpoint folder of the same state_dict (default "
                        "torch)")


def _add_verify(commands: Commands) -> None:
    verify = commands.add_parser(
        "verify",
        help="prove that distributed training of SCRIPT equals its one-process run",
        description="Run SCRIPT for --steps steps twice: in one process with the global batch "
        "(a parallax.distribute program in plain PyTorch) and distributed on a local cluster, "
        "with torch's default dtype float64 unless --dtype program; print, per parameter and "
        "buffer, the largest difference and the first step above the tolerance. Exit status "
        "0 when equal, 1 when different, 2 when a run failed. The program must take its data "
        "through parallax.shard and train through parallax.distribute or parallax.get_runner.")
    verify.add_argument("--machines", type=int, default=2, metavar="M",
                        help="emulated machines of the distributed run (default 2)")
    verify.add_argument("--nproc-per-machine", type=int, default=1, metavar="K",
                        help="workers per machine (default 1)")
    verify.add_argument("--steps", type=int, default=20, metavar="N",
                        help="training steps to compare (default 20)")
    verify.add_argument("--tolerance", type=float, metavar="T",
                        help="largest absolute difference taken as equal (default 1e-9 in "
                        "float64, 1e-5 with --dtype program)")
    verify.add_argument("--dtype", choices=["float64", "program"], default="float64",
                        help="float64: torch.set_default_dtype(torch.float64) before the "
                        "program runs (default); program: the program's own dtypes")
    verify.add_argument("--timeout", type=float, default=600.0, metavar="S",
                        help="seconds each run may take (default 600)")
    verify.add_argument("--reference", metavar="ORIGINAL", default=None,
                        help="the reference run is ORIGINAL (a script and its arguments, one "
                        "string): the single-device program before the port, with no "
                        "parallax in it, each DataLoader batching W x its batch_size; "
                        "default: SCRIPT itself on one process")
    verify.add_argument("--keep", metavar="DIR", help="keep the recorded states and logs here")
    verify.add_argument("--json", metavar="FILE", default="",
                        help="also write the comparison here")
    verify.add_argument("script", help="the training script")
    verify.add_argument("script_args", nargs=argparse.REMAINDER,
                        help="arguments for the script")


def _add_manifest(commands: Commands) -> None:
    manifest = commands.add_parser(
        "manifest",
        help="print a Kubernetes PyTorchJob that runs a script on several pods",
        description="Print a Kubeflow PyTorchJob (JSON, which kubectl apply -f takes like YAML) "
        "whose pods run `torchrun --nproc-per-node K SCRIPT ARGS`; the training operator sets "
        "the variables torchrun reads (PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR, ...) and "
        "parallax joins torchrun's launch. The image must hold the script and parallax.")
    manifest.add_argument("--name", required=True, help="the job's Kubernetes name")
    manifest.add_argument("--image", required=True, help="container image")
    manifest.add_argument("--nodes", type=int, default=2, help="pods (machines; default 2)")
    manifest.add_argument("--nproc-per-node", type=int, default=1, metavar="K",
                          help="workers per pod (default 1)")
    manifest.add_argument("--gpus-per-node", type=int, default=0, metavar="G",
                          help="nvidia.com/gpu limit per pod (default 0)")
    manifest.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                          help="a variable for the workers (repeatable)")
    manifest.add_argument("script", help="the training script, as the image holds it")
    manifest.add_argument("script_args", nargs=argparse.REMAINDER)


def _add_cluster_arguments(command: argparse.ArgumentParser) -> None:
    where = command.add_mutually_exclusive_group(required=True)
    where.add_argument("--resources", metavar="FILE", help="resource file: host[:dev,...] lines")
    where.add_argument("--machines", type=int, metavar="M", help="emulate M machines locally")
    where.add_argument("--slurm", action="store_true",
                       help="this node's agent of a SLURM job (under srun --ntasks-per-node=1: "
                       "machines from SLURM_JOB_NODELIST, this one from SLURM_NODEID)")
    where.add_argument("--nnodes", metavar="N",
                       help="torchrun's: this host is one of N nodes (with --node-rank and "
                       "--master-addr or --rdzv-endpoint when N > 1); a fixed N (an elastic "
                       "MIN:MAX range is not taken: a run's shape is fixed, restarts resume it)")
    where.add_argument("--standalone", action="store_true",
                       help="torchrun's: one node, rendezvous on this host (as --nnodes 1)")
    command.add_argument(
        "--nproc-per-machine", "--nproc-per-node", "--nproc_per_node", type=int, metavar="K",
        dest="nproc_per_machine",
        help="workers per machine (--nproc-per-node: torchrun's name; with --nnodes or "
        "--standalone default 1; with --slurm default SLURM_GPUS_ON_NODE or 1)")
    command.add_argument(
        "--machine-index", "--node-rank", "--node_rank",
        type=int,
        metavar="I",
        dest="machine_index",
        help="this host's machine: its line in the resources (needed for remote hosts), or "
        "its rank among --nnodes (torchrun's --node-rank)",
    )
    command.add_argument(
        "-m", "--module", action="store_true",
        help="SCRIPT is a Python module, run as python -m SCRIPT (as torchrun's -m)")
    command.add_argument(
        "--start-method", choices=START_METHODS, default=None,
        help="how each worker starts: exec, a fresh `python -u SCRIPT` (default; "
        f"{START_METHOD_ENV} sets another), or forkserver, forked from a process that "
        "imported torch once (seconds less per worker; see parallax.launch.warm)")
    command.add_argument(
        "--emulate-network",
        metavar="RATE",
        help="with --machines: each machine in its own network namespace, links limited to "
        "RATE (tc syntax: 100mbit, 1gbit); needs root and iproute2",
    )
    ssh = command.add_argument_group(
        "other hosts", "with --resources naming other hosts: each is started over ssh "
        "(BatchMode), in this working directory, with this Python's path")
    ssh.add_argument("--ssh-user", metavar="USER", help="ssh login name")
    ssh.add_argument("--ssh-port", type=int, metavar="PORT", help="ssh port")
    ssh.add_argument("--ssh-identity", metavar="FILE", help="ssh identity (private key) file")
    ssh.add_argument("--ssh-option", action="append", default=[], metavar="KEY=VALUE",
                     help="an ssh -o option (repeatable)")
    ssh.add_argument("--remote-python", metavar="PATH",
                     help="the Python on the other hosts (default: this one's path)")
    ssh.add_argument("--env", action="append", default=[], metavar="NAME[=VALUE]",
                     help="also forward this variable (default: PARALLAX_*, TORCH_*, NCCL_*, "
                     "GLOO_*, OMP_*, MKL_*, CUDA_*, PYTHONPATH; repeatable)")
    command.add_argument("--master-addr", "--master_addr", metavar="A", dest="master_addr",
                         help="rendezvous host")
    command.add_argument("--master-port", "--master_port", type=int, metavar="P",
                         dest="master_port", help="rendezvous port (default: with "
                         "--resources, a free port when the first machine is this host, else "
                         "29500)")
    command.add_argument("--rdzv-endpoint", "--rdzv_endpoint", metavar="HOST[:PORT]",
                         dest="rdzv_endpoint",
                         help="torchrun's: the rendezvous host and port, as --master-addr and "
                         "--master-port")
    command.add_argument("script", help="the training script (a module's name with -m)")
    command.add_argument("script_args", nargs=argparse.REMAINDER,
                         help="arguments for the script")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the process exit status."""
    args = build_parser().parse_args(argv)
    if args.command == "export":
        return _export(args)
    if args.command == "manifest":
        return _manifest(args)
    if args.command == "verify":
        return _verify(args)
    return _run(args.command_parser, args)


def _script_command(args: argparse.Namespace) -> list[str]:
    """What the workers' Python runs: the script and its arguments (``-m`` for a module)."""
    return [*(["-m"] if args.module else []), args.script, *args.script_args]


def _manifest(args: argparse.Namespace) -> int:
    """``parallax manifest``: a PyTorchJob for Kubernetes, on stdout."""
    from parallax.launch.schedulers import pytorchjob_manifest

    env = {}
    for item in args.env:
        name, sep, value = item.partition("=")
        if not name or not sep:
            return _fail(f"--env {item!r}: expected NAME=VALUE")
        env[name] = value
    try:
        job = pytorchjob_manifest(args.name, args.image, nodes=args.nodes,
                                  nproc_per_node=args.nproc_per_node,
                                  command=[args.script, *args.script_args],
                                  gpus_per_node=args.gpus_per_node, env=env)
    except ValueError as err:
        return _fail(str(err))
    print(json.dumps(job, indent=2))
    return 0


def _verify(args: argparse.Namespace) -> int:
    """``parallax verify``: the two runs and their comparison (`parallax.verify`)."""
    from parallax.verify.command import VerifyOptions, verify

    if not os.path.isfile(args.script):
        return _fail(f"no such script: {args.script}")
    for flag, value in (("--machines", args.machines), ("--nproc-per-machine",
                        args.nproc_per_machine), ("--steps", args.steps)):
        if value < 1:
            return _fail(f"{flag} must be at least 1, got {value}")
    if args.tolerance is not None and not args.tolerance >= 0:
        return _fail(f"--tolerance must be a number >= 0, got {args.tolerance}")
    if not args.timeout > 0:
        return _fail(f"--timeout must be positive, got {args.timeout}")
    reference = shlex.split(args.reference) if args.reference is not None else None
    if reference is not None and (not reference or not os.path.isfile(reference[0])):
        return _fail(f"--reference: no such script: {args.reference!r}")
    return verify(VerifyOptions(
        args.script, list(args.script_args), machines=args.machines,
        nproc_per_machine=args.nproc_per_machine, steps=args.steps, tolerance=args.tolerance,
        float64=args.dtype == "float64", timeout_s=args.timeout, keep=args.keep,
        json_path=args.json or None, reference=reference))


def _export(args: argparse.Namespace) -> int:
    """``parallax export``: a bad or corrupt checkpoint is the user's problem, not a bug, so
    it gets a one-line error naming the file rather than a traceback."""
    from parallax.checkpoint.export import stream_export
    from parallax.checkpoint.files import CheckpointError  # imports torch

    try:
        if args.format == "dcp":
            from parallax.checkpoint.dcp import export_dcp

            print(f"parallax: exported {args.checkpoint} as a DCP checkpoint to "
                  f"{export_dcp(args.checkpoint, args.out)}")
            return 0
        exported = stream_export(args.checkpoint, args.out)
    except CheckpointError as err:
        return _fail(str(err))
    except OSError as err:
        return _fail(f"cannot write {args.out}: {err}")
    print(f"parallax: exported step {exported.step} ({exported.tensors} tensors) "
          f"to {exported.path}")
    return 0


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``parallax run``: check the arguments cheaply, then hand over to the launcher."""
    try:
        spec = _spec_from_args(parser, args)
    except (ResourceError, OSError) as err:
        return _fail(str(err))
    if not args.module and not os.path.isfile(args.script):
        return _fail(f"no such script: {args.script}" + (
            " (a module? give -m)" if "." in args.script and not args.script.endswith(".py")
            else ""))

    max_restarts = getattr(args, "max_restarts", 0)  # only ``run`` has the flag
    if max_restarts < 0:
        return _fail(f"--max-restarts must be at least 0, got {max_restarts}")

    env = {START_METHOD_ENV: args.start_method} if args.start_method else {}
    timeline = getattr(args, "timeline", None)  # only ``run`` has the flag
    if timeline:
        from parallax.cluster import TIMELINE_ENV

        timeline = os.path.abspath(timeline)
        env[TIMELINE_ENV] = timeline
        if os.path.exists(timeline):  # rank 0 writes it anew (or not at all: no step ran)
            os.remove(timeline)
    status = _launch(parser, args, spec, env, max_restarts)
    if timeline:
        # rank 0 wrote every rank's phases there (`phases.PhaseClock.write`); on another
        # host when the first machine is not this one
        said = (f"written to {timeline}" if os.path.exists(timeline) else
                "empty: no step ran" if spec.is_local() else
                f"written by rank 0 to {timeline} on {spec.machines[0].host}")
        print(f"parallax: timeline {said}", file=sys.stderr)
    return status


def _launch(parser: argparse.ArgumentParser, args: argparse.Namespace, spec: ResourceSpec,
            env: dict[str, str], max_restarts: int) -> int:
    """Start the workers the way the arguments say; the job's exit status."""
    if args.command == "plan":
        if args.warmup_steps < 1:
            return _fail("--warmup-steps must be at least 1")
        json_path = os.path.abspath(args.json) if args.json else ""
        env = {**env, PLAN_ONLY_ENV: json_path, PLAN_WARMUP_ENV: str(args.warmup_steps)}
    if args.emulate_network:
        return _run_emulated(args, env, max_restarts)
    if args.slurm:
        return _run_slurm(args, env, max_restarts)
    if args.machine_index is None and args.resources is not None and not spec.is_local():
        return _run_over_ssh(args, spec, env, max_restarts)
    # imports torch: here only, so that usage errors stay fast and the launchers of emulated
    # and remote machines (which only start agents) never load it
    from parallax.launch.elastic import launch

    try:
        return launch(
            spec,
            _script_command(args),
            machine_index=args.machine_index,
            master_addr=args.master_addr,
            master_port=args.master_port,
            env=env,
            max_restarts=max_restarts,
        )
    except ValueError as err:
        return _fail(str(err))


def _run_emulated(args: argparse.Namespace, env: dict[str, str], max_restarts: int) -> int:
    """Each emulated machine in a network namespace with a rate-limited link; one elastic
    agent per machine; the links' byte counters reported at the end."""
    import tempfile

    from parallax.errors import NetemError
    from parallax.launch.executors import NamespaceExecutor, launch_machines, omp_threads
    from parallax.launch.netem import OFFLINE_ENV, EmulatedNetwork

    if args.resources is not None:
        return _fail("--emulate-network goes with --machines, not --resources")
    try:
        with EmulatedNetwork(args.machines, args.emulate_network) as net, \
                tempfile.TemporaryDirectory(prefix="parallax-netem-") as tmp:
            devices = ",".join(map(str, range(args.nproc_per_machine)))
            text = "".join(f"{net.address(m)}:{devices}\n" for m in range(args.machines))
            spec_file = os.path.join(tmp, "resources.txt")
            with open(spec_file, "w") as out:
                out.write(text)
            # launch_machines runs ``parallax run <its options> CMD`` per machine: options
            # put before the script reach each machine's ``run`` (``--max-restarts`` there).
            restarts = ["--max-restarts", str(max_restarts)] if max_restarts else []
            code = launch_machines(
                spec_file, parse_resources(spec_file),
                [*restarts, *_script_command(args)],
                [NamespaceExecutor(net.namespace(m)) for m in range(args.machines)],
                master_port=args.master_port or 29400,
                # c10d warns once per connection that the namespace cannot resolve names.
                env={"TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR"),
                     # All machines share this host's cores: without this each agent sizes
                     # its workers' thread pools for the whole host.
                     "OMP_NUM_THREADS": omp_threads(args.machines * args.nproc_per_machine),
                     # Namespaces reach only each other: downloads there fail at once,
                     # naming the corpus (corpora.cache.require_online in examples/).
                     OFFLINE_ENV: "1",
                     **env, "GLOO_SOCKET_IFNAME": "eth0"})
            for machine, link in enumerate(net.counters()):
                print(f"parallax: machine {machine} link ({args.emulate_network}): sent "
                      f"{link.sent:,} B, received {link.received:,} B", file=sys.stderr)
            return code
    except NetemError as err:
        return _fail(str(err))


def _run_slurm(args: argparse.Namespace, env: dict[str, str], max_restarts: int) -> int:
    """This node's agent of a SLURM job (one srun task per node)."""
    from parallax.launch.elastic import launch
    from parallax.launch.schedulers import slurm_job

    try:
        job = slurm_job(os.environ, nproc_per_machine=args.nproc_per_machine,
                        master_port=args.master_port)
        return launch(job.spec, _script_command(args),
                      machine_index=job.machine_index, master_addr=args.master_addr
                      or job.master_addr, master_port=job.master_port, env=env,
                      max_restarts=max_restarts)
    except (ValueError, ResourceError) as err:
        return _fail(str(err))


def _run_over_ssh(args: argparse.Namespace, spec: ResourceSpec, env: dict[str, str],
                  max_restarts: int) -> int:
    """Every machine of the resource file from here: this host's locally, the others over
    ssh, one rendezvous on the first machine; a failure anywhere stops all of them."""
    from parallax.cluster import free_port, is_local_host
    from parallax.launch.executors import (
        LocalExecutor,
        SshExecutor,
        SshOptions,
        forwarded_environment,
        launch_machines,
    )

    first = spec.machines[0].host
    if first in ("localhost", "localhost.localdomain", "::1") or first.startswith("127."):
        return _fail(f"{args.resources} line {spec.machines[0].line}: the first machine is the "
                     f"rendezvous the other hosts connect to; name it by an address they can "
                     f"reach, not {first}")
    extra = {}
    for item in args.env:
        name, sep, value = item.partition("=")
        if not name:
            return _fail(f"--env {item!r}: expected NAME or NAME=VALUE")
        if not sep and name not in os.environ:
            return _fail(f"--env {name}: not set here (give NAME=VALUE)")
        extra[name] = value if sep else os.environ[name]
    options = SshOptions(user=args.ssh_user, port=args.ssh_port, identity=args.ssh_identity,
                         options=tuple(args.ssh_option),
                         python=args.remote_python or sys.executable)
    executors = [LocalExecutor() if is_local_host(m.host)
                 else SshExecutor(m.host, workdir=os.getcwd(), options=options)
                 for m in spec.machines]
    restarts = ["--max-restarts", str(max_restarts)] if max_restarts else []
    # the rendezvous listens on the first machine: a port free there when that is this host
    # (two jobs on one host side by side), else torch's customary 29500
    port = args.master_port or (free_port() if is_local_host(first) else 29500)
    return launch_machines(os.path.abspath(args.resources), spec,
                           [*restarts, *_script_command(args)], executors, master_port=port,
                           env=forwarded_environment({**env, **extra}))


def _spec_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ResourceSpec:
    """The resource spec from --resources, from --machines/--nproc-per-machine, or from
    torchrun's --nnodes/--standalone (--slurm: read from SLURM's variables later; the local
    spec stands in for the checks). Settles --rdzv-endpoint into the master's address."""
    _settle_endpoint(parser, args)
    if args.nnodes is not None or args.standalone:
        return _torchrun_spec(parser, args)
    if args.slurm:
        if args.machine_index is not None or args.emulate_network:
            parser.error("--slurm takes the machine from SLURM_NODEID; no --machine-index or "
                         "--emulate-network")
        return local_spec(1, 1)
    if args.resources is not None:
        if args.nproc_per_machine is not None:
            parser.error("--nproc-per-machine goes with --machines, not --resources")
        return parse_resources(args.resources)
    if args.nproc_per_machine is None:
        parser.error("--machines needs --nproc-per-machine")
    if args.machines < 1 or args.nproc_per_machine < 1:
        parser.error("--machines and --nproc-per-machine must be at least 1")
    return local_spec(args.machines, args.nproc_per_machine)


def _settle_endpoint(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--rdzv-endpoint HOST[:PORT] as --master-addr HOST --master-port PORT."""
    if args.rdzv_endpoint is None:
        return
    if args.master_addr is not None or args.master_port is not None:
        parser.error("--rdzv-endpoint names the rendezvous: no --master-addr or --master-port "
                     "with it")
    host, sep, port = args.rdzv_endpoint.rpartition(":")
    if not sep or host.endswith(":"):  # no port, or an IPv6 address without brackets
        host, port = args.rdzv_endpoint, ""
    if not host or (port and not port.isdigit()):
        parser.error(f"--rdzv-endpoint {args.rdzv_endpoint!r}: expected HOST or HOST:PORT")
    args.master_addr = host.strip("[]")
    args.master_port = int(port) if port else None


def _torchrun_spec(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ResourceSpec:
    """torchrun's --nnodes N / --standalone: N machines of --nproc-per-node workers (default 1);
    with N > 1 this host is machine --node-rank of a rendezvous at --master-addr."""
    if args.emulate_network:
        parser.error("--emulate-network goes with --machines (emulated machines on this host), "
                     "not --nnodes")
    nodes = 1 if args.standalone else _fixed_nodes(parser, args.nnodes)
    workers = 1 if args.nproc_per_machine is None else args.nproc_per_machine
    if nodes < 1 or workers < 1:
        parser.error("--nnodes and --nproc-per-node must be at least 1")
    if nodes == 1:
        if args.machine_index not in (None, 0):
            parser.error(f"--node-rank {args.machine_index} of a single node: give 0 or nothing")
        args.machine_index = None  # one agent for the node's workers, on a free local port
        return local_spec(1, workers)
    if args.machine_index is None:
        parser.error(f"--nnodes {nodes} needs this host's --node-rank (0..{nodes - 1}); to "
                     f"emulate {nodes} machines on this host use --machines {nodes}")
    if args.master_addr is None:
        parser.error(f"--nnodes {nodes} needs the rendezvous host every node reaches: "
                     "--master-addr HOST (and --master-port) or --rdzv-endpoint HOST:PORT, the "
                     "host of --node-rank 0")
    if not 0 <= args.machine_index < nodes:
        parser.error(f"--node-rank {args.machine_index} outside 0..{nodes - 1}")
    return local_spec(nodes, workers)


def _fixed_nodes(parser: argparse.ArgumentParser, text: str) -> int:
    """--nnodes N, or N:N (torchrun's elastic MIN:MAX form with one value)."""
    low, sep, high = text.partition(":")
    if not low.isdigit() or (sep and high != low):
        parser.error(f"--nnodes {text!r}: give a number of nodes (an elastic range MIN:MAX is "
                     "not taken: a parallax run's cluster shape is fixed, and a restart "
                     "resumes it)")
    return int(low)


def _fail(message: str) -> int:
    """Report a usage problem the way argparse does, without the usage text."""
    print(f"parallax: error: {message}", file=sys.stderr)
    return USAGE_ERROR


def entry() -> NoReturn:
    """The ``parallax`` command: `main`, then the process ends at once
    (`parallax.launch.fast_exit`: every file, worker and emulated link of the run is closed
    by then, and half a second of torch's teardown is saved on every launch). An error
    raised by `main` ends the process the normal way."""
    exit_now(main())


if __name__ == "__main__":
    entry()
