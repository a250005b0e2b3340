"""Start a job's workers through torch's elastic agent.

Using ``torch.distributed.launcher`` (what ``torchrun`` uses) gives us its rendezvous, its
per-worker environment (RANK, WORLD_SIZE, MASTER_ADDR, ...) and, above all, its failure
handling: when one worker dies the agent terminates the others instead of letting them hang
in a collective, and, with ``max_restarts``, starts them all again (a fresh rendezvous; the
workers see TORCHELASTIC_RESTART_COUNT) until the restarts are used up.  We add the
resource spec (``PARALLAX_RESOURCES``) so that workers know the machine layout, and a
one-line-per-rank failure report.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import tempfile
import time
import traceback
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import cast

from torch import __version__ as torch_version
from torch._C._distributed_c10d import PrefixStore, TCPStore
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.api import PContext
from torch.distributed.elastic.multiprocessing.errors import (
    ChildFailedError,
    ErrorHandler,
    ProcessFailure,
)
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import (
    StaticTCPRendezvous,
    create_rdzv_handler,
)
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from parallax.atomic import replace_text
from parallax.checks import is_int
from parallax.cluster import RESOURCES_ENV, EnvironmentPatch, ResourceSpec, free_port
from parallax.engine.diagnostics.progress import CULPRIT
from parallax.errors import ArgumentError
from parallax.launch.executors import omp_threads
from parallax.launch.warm import (
    START_METHOD_ENV,
    START_METHODS,
    preloaded_forkserver,
    protocol_understood,
    run_script,
)

__all__ = ["AgentSetup", "WholeFileErrorHandler", "install_error_recorder", "launch",
           "agent_setup"]

log = logging.getLogger("parallax")

DEFAULT_MASTER_PORT = 29500
#: Rendezvous id; the agents of one job must agree on it (it prefixes their store keys).
RUN_ID = "parallax"
#: Seconds between the agent's checks of its workers; small so a failure stops the rest fast.
MONITOR_INTERVAL = 0.1
_ELASTIC_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher",
                    "torch.multiprocessing")
_ELASTIC_LOG_LEVEL = logging.ERROR
#: The agent's logger that says (at INFO) when it restarts the worker group.
_AGENT_LOGGER = "torch.distributed.elastic.agent.server.api"
_SUMMARY_CHARS = 200
# Signals the elastic agent takes over while it runs; we restore our handlers afterwards.
_AGENT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
# Signals the agent itself uses to stop workers after another one failed.
# The agent stops healthy workers with SIGTERM (SIGKILL only after a long grace period), so a
# SIGKILL is somebody else's: the OOM killer, an operator, a crashed machine.
_STOP_SIGNALS = frozenset({-signal.SIGTERM})
#: Our rendezvous backend for jobs that may restart (see `_RestartableRendezvous`).
RESTARTABLE_RDZV_BACKEND = "parallax-static"
_WORKER_PORT_KEY = "parallax/worker_store_port"


@dataclass(frozen=True)
class AgentSetup:
    """What the elastic agent on this host runs: its node in the job and its rendezvous."""

    nnodes: int
    node_rank: int
    nproc_per_node: int
    master_addr: str
    master_port: int


def agent_setup(
    spec: ResourceSpec,
    *,
    machine_index: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
) -> AgentSetup:
    """Decide this host's agent: one for all workers of a local spec, else one per machine.

    A local spec without ``machine_index`` runs every emulated machine's workers under a
    single agent on a free loopback port.  Otherwise this host is machine ``machine_index``
    of a static rendezvous whose master defaults to the first machine.
    """
    if machine_index is None:
        if not spec.is_local():
            hosts = ", ".join(sorted({m.host for m in spec.machines}))
            raise ArgumentError(
                f"the resources name remote hosts ({hosts}): run the launcher on every machine "
                "and give each its machine index (--machine-index)"
            )
        return AgentSetup(
            nnodes=1,
            node_rank=0,
            nproc_per_node=spec.world_size,
            master_addr=master_addr or "127.0.0.1",
            master_port=master_port or free_port(),
        )
    return _machine_setup(spec, machine_index, master_addr, master_port)


def _machine_setup(
    spec: ResourceSpec, index: int, master_addr: str | None, master_port: int | None
) -> AgentSetup:
    """Plan for one machine of a multi-agent job; torch needs equal workers per machine."""
    if not 0 <= index < len(spec.machines):
        raise ArgumentError(f"machine index {index} out of range 0..{len(spec.machines) - 1}")
    counts = sorted({m.num_workers for m in spec.machines})
    if len(counts) > 1:
        raise ArgumentError(
            "every machine must run the same number of workers for a multi-machine launch; "
            f"the resources give {', '.join(map(str, counts))}"
        )
    return AgentSetup(
        nnodes=len(spec.machines),
        node_rank=index,
        nproc_per_node=counts[0],
        master_addr=master_addr or spec.machines[0].host,
        master_port=master_port or DEFAULT_MASTER_PORT,
    )


def _launch_config(agent: AgentSetup, log_dir: str, max_restarts: int = 0,
                   start_method: str = "spawn") -> LaunchConfig:
    """torch's launch config for ``agent``: static rendezvous, fast monitoring, and up to
    ``max_restarts`` restarts of the whole worker group.

    ``log_dir`` receives the workers' error files (torch would leave a temp dir behind).
    With restarts the rendezvous is our restartable variant of torch's static one (same node
    ranks, a fresh store for each attempt's workers).
    """
    if max_restarts:
        rendezvous_handler_registry.register(RESTARTABLE_RDZV_BACKEND, _restartable_handler)
    host = f"[{agent.master_addr}]" if ":" in agent.master_addr else agent.master_addr
    return LaunchConfig(
        min_nodes=agent.nnodes,
        max_nodes=agent.nnodes,
        nproc_per_node=agent.nproc_per_node,
        run_id=RUN_ID,
        role="parallax",
        rdzv_endpoint=f"{host}:{agent.master_port}",
        rdzv_backend=RESTARTABLE_RDZV_BACKEND if max_restarts else "static",
        rdzv_configs={"rank": agent.node_rank},
        max_restarts=max_restarts,
        monitor_interval=MONITOR_INTERVAL,
        start_method=start_method,
        logs_specs=DefaultLogsSpecs(log_dir=log_dir),
    )


class _RestartableRendezvous(RendezvousHandler):
    """torch's static rendezvous (node rank = machine index), giving every attempt's workers
    a store of their own.

    With the static backend all attempts' workers share the agents' store, and the keys a
    first attempt's ``init_process_group`` left there (peer addresses, barrier counters) make
    a restarted attempt's workers connect to dead peers or wait forever; torch's dynamic
    backends avoid that by creating a store per round, but number the nodes as they arrive,
    not by machine.  Here the agent of node 0 starts a new TCPStore on a free port for each
    round and tells the others its port through the agents' store, under the round's prefix
    (the agents' own keys are per round too).
    """

    def __init__(self, static: StaticTCPRendezvous) -> None:
        self._static = static
        self._round = 0
        self._worker_store: TCPStore | None = None  # node 0 keeps the current one serving

    def get_backend(self) -> str:
        return RESTARTABLE_RDZV_BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True  # the workers connect to the store we give them, as with static

    def next_rendezvous(self) -> RendezvousInfo:
        info = self._static.next_rendezvous()
        store = PrefixStore(f"round-{self._round}", info.store)
        self._round += 1
        static = self._static
        if info.rank == 0:
            self._worker_store = TCPStore(static.master_addr, 0, None, True, static.timeout,
                                          wait_for_workers=False)
            store.set(_WORKER_PORT_KEY, str(self._worker_store.port))
        port = int(store.get(_WORKER_PORT_KEY))
        return RendezvousInfo(store, info.rank, info.world_size,
                              RendezvousStoreInfo(static.master_addr, port))

    def is_closed(self) -> bool:
        return bool(self._static.is_closed())

    def set_closed(self) -> None:
        self._static.set_closed()

    def num_nodes_waiting(self) -> int:
        return int(self._static.num_nodes_waiting())

    def get_run_id(self) -> str:
        return self._static.get_run_id()

    def shutdown(self) -> bool:
        self._worker_store = None
        return self._static.shutdown()


def _restartable_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torch's rendezvous registry entry for `RESTARTABLE_RDZV_BACKEND`."""
    return _RestartableRendezvous(cast(StaticTCPRendezvous, create_rdzv_handler(params)))


def launch(
    spec: ResourceSpec,
    cmd: list[str],
    *,
    machine_index: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    env: Mapping[str, str] | None = None,
    max_restarts: int = 0,
    start_method: str | None = None,
) -> int:
    """Run ``python -u *cmd`` as this host's workers of ``spec``; return an exit status.

    Returns 0 when every worker succeeded.  When one fails the agent stops the others; with
    restarts left it starts all of this host's workers again (``max_restarts`` times at most:
    transient faults need not end a long job).  Once none are left, a line per failed rank
    of the last attempt goes to stderr and the first failure's exit code is returned.
    ``env`` adds variables to the workers' environment. ``start_method`` is how each worker
    starts: ``exec``, a fresh interpreter, or ``forkserver``, forked from one that imported
    torch once (`parallax.launch.warm`); by default the ``PARALLAX_START_METHOD`` variable of
    ``env``, else of this process, else ``exec``. An agent that starts one worker once (one
    per machine, no restarts) execs it: there is nothing for a fork server to share.

    With one agent per machine (``machine_index``) each agent restarts only its own workers;
    the other machines' workers restart when their collectives fail against the dead peer
    (gloo at once, NCCL after its watchdog timeout), and then all meet in the next round's
    fresh store (`_RestartableRendezvous`).  A machine whose workers never notice (they had
    finished, or talk to no one) does not restart, and the rest wait in the rendezvous until
    its timeout (600 s).
    """
    if not cmd:
        raise ArgumentError("nothing to launch: cmd is empty")
    if not is_int(max_restarts, at_least=0):
        raise ArgumentError(f"max_restarts must be an int >= 0, got {max_restarts!r}")
    method = (start_method or (env or {}).get(START_METHOD_ENV)
              or os.environ.get(START_METHOD_ENV) or "exec")
    if method not in START_METHODS:
        raise ArgumentError(f"start_method must be one of {', '.join(START_METHODS)}, got "
                            f"{method!r}" + (f" (from {START_METHOD_ENV})" if not start_method
                                             else ""))
    if method == "forkserver" and not protocol_understood():
        raise ArgumentError("start_method='forkserver' does not know this torch's elastic "
                            f"worker wrapper (torch {torch_version}); use 'exec'")
    agent = agent_setup(
        spec, machine_index=machine_index, master_addr=master_addr, master_port=master_port
    )
    if agent.nproc_per_node == 1 and not max_restarts:
        method = "exec"  # one start of one worker: a fork server would only add its own
    forked = method == "forkserver"
    # torch elastic runs a binary's workers by exec and a function's by multiprocessing
    entrypoint, args = (run_script, cmd) if forked else (sys.executable, ["-u", *cmd])
    worker_env = {RESOURCES_ENV: spec.to_json(), **(env or {})}
    worker_env.setdefault("OMP_NUM_THREADS", omp_threads(agent.nproc_per_node))
    with (
        tempfile.TemporaryDirectory(prefix="parallax-") as log_dir,
        _quiet_elastic_logs(),
        _announced_restarts(),
        _stopped_workers_continued(),
        _restored_signal_handlers(),
        # The agent also writes TORCHELASTIC_SIGNALS_TO_HANDLE into os.environ: undo that too.
        EnvironmentPatch(worker_env, restoring=["TORCHELASTIC_SIGNALS_TO_HANDLE"]),
        preloaded_forkserver() if forked else contextlib.nullcontext(),
    ):
        try:
            config = _launch_config(agent, log_dir, max_restarts,
                                    "forkserver" if forked else "spawn")
            elastic_launch(config, entrypoint)(*args)
        except ChildFailedError as err:
            if max_restarts:
                print(f"parallax: the job still failed after {max_restarts} restart(s)",
                      file=sys.stderr)
            return _report_failures(_with_recorded_siblings(err.failures), spec)
        except SignalException as err:
            print(f"parallax: launcher got {err.sigval.name}; workers stopped", file=sys.stderr)
            return 128 + int(err.sigval)
    return 0


@contextlib.contextmanager
def _stopped_workers_continued() -> Iterator[None]:
    """When the agent stops the workers (a failure, a restart, the end), continue any that is
    stopped (SIGSTOP, a debugger, a suspended job) before torch's ``PContext.close`` sends its
    SIGTERM: a stopped process cannot act on it, so torch waited its whole 30 s grace for
    one before the SIGKILL, and a stalled job took the collective timeout + 30 s to end."""
    original = PContext.close

    def close(self: PContext, death_sig: signal.Signals | None = None,
              timeout: int = 30) -> None:
        for pid in self.pids().values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGCONT)
        original(self, death_sig, timeout)

    PContext.close = close  # type: ignore[method-assign]
    try:
        yield
    finally:
        PContext.close = original  # type: ignore[method-assign]


@contextlib.contextmanager
def _restored_signal_handlers() -> Iterator[None]:
    """The agent installs handlers that raise SignalException; put the old ones back."""
    signums = [getattr(signal, name) for name in _AGENT_SIGNALS if hasattr(signal, name)]
    saved = {signum: signal.getsignal(signum) for signum in signums}
    try:
        yield
    finally:
        for signum, handler in saved.items():
            if handler is not None:
                signal.signal(signum, handler)


@contextlib.contextmanager
def _quiet_elastic_logs() -> Iterator[None]:
    """Keep torch elastic to ERROR+ while we run: our report replaces its warnings.

    Its WARNING lines (one "Sending process N closing signal SIGTERM" per stopped worker)
    only repeat what the report says, and its ERROR lines stay one line each (a forked
    worker's failure is logged with the agent's own traceback, which says nothing about the
    worker's).  Setting LOGLEVEL (torchrun's knob) keeps torch's own levels.
    """
    if "LOGLEVEL" in os.environ:
        yield
        return
    loggers = [
        logging.getLogger(name)
        for name in list(logging.root.manager.loggerDict)
        if name.startswith(_ELASTIC_LOGGERS)
    ]
    saved = [(lg, lg.level) for lg in loggers]
    one_line = _WithoutTraceback()
    for lg in loggers:
        lg.setLevel(max(lg.level, _ELASTIC_LOG_LEVEL))
        lg.addFilter(one_line)
    try:
        yield
    finally:
        for lg, old in saved:
            lg.setLevel(old)
            lg.removeFilter(one_line)


class _WithoutTraceback(logging.Filter):
    """Log a record without the traceback it carries."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info = None
        record.exc_text = None
        return True


class _RestartAnnouncer(logging.Filter):
    """Print a parallax line when the agent restarts the workers; let the agent logger's other
    records through only from ``threshold`` up (its level before we lowered it to INFO)."""

    def __init__(self, threshold: int) -> None:
        super().__init__()
        self.threshold = threshold

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if "attempts left" in str(record.msg) and isinstance(args, tuple) and len(args) == 4:
            _role, state, left, total = args
            with contextlib.suppress(TypeError, ValueError):
                print(f"parallax: worker group {str(state).lower()}; restarting all workers "
                      f"(restart {int(str(total)) - int(str(left)) + 1} of {int(str(total))})",
                      file=sys.stderr)
        return record.levelno >= self.threshold


@contextlib.contextmanager
def _announced_restarts() -> Iterator[None]:
    """Say when the agent restarts the workers: the worker failure it follows is logged at
    ERROR, but the restart itself only at INFO, below what we (or the user) let through, and a
    job that silently started over would be puzzling."""
    agent_logger = logging.getLogger(_AGENT_LOGGER)
    saved_level = agent_logger.level
    announcer = _RestartAnnouncer(agent_logger.getEffectiveLevel())
    agent_logger.setLevel(min(logging.INFO, announcer.threshold))
    agent_logger.addFilter(announcer)
    try:
        yield
    finally:
        agent_logger.removeFilter(announcer)
        agent_logger.setLevel(saved_level)


def _report_failures(failures: Mapping[int, ProcessFailure], spec: ResourceSpec) -> int:
    """Print a line per failed rank (root cause first); return the root cause's status."""
    own, stopped = _split_stopped(failures)
    reported: set[int] = set()  # ranks whose own failure is printed
    for rank in own:
        failure = failures[rank]
        summary = _failure_summary(failure)
        waited = CULPRIT.match(summary)
        if waited and waited.group(1) in ("StalledRankError", "LostRankError"):
            # The rank whose wait failed found who did not arrive: name that one first.
            line = _waited_for(rank, int(waited.group(2)), waited.group(1), spec, reported)
            print(f"parallax: {line}: {summary}", file=sys.stderr)
            continue
        print(
            f"parallax: rank {rank} (machine {spec.machine_of_rank[rank]}) failed: "
            f"exit code {_describe_exit(failure.exitcode)}: {summary}",
            file=sys.stderr,
        )
        reported.add(rank)
    if stopped:
        ranks = ", ".join(map(str, stopped))
        print(f"parallax: stopped rank(s) {ranks} after the failure", file=sys.stderr)
    return _exit_status(failures[own[0]].exitcode)


def _waited_for(rank: int, culprit: int, error: str, spec: ResourceSpec,
                reported: set[int]) -> str:
    """How ``rank``'s failed wait for ``culprit`` reads: after a crash already reported (a
    consequence), a lost peer (its connection closed: crashed or killed), or a stalled one."""
    where = f"rank {culprit} (machine {spec.machine_of_rank[culprit]})"
    if culprit in reported:
        return (f"rank {rank} (machine {spec.machine_of_rank[rank]}) failed after {where} "
                "was lost")
    if error == "LostRankError":
        return f"{where} was lost (crashed or killed); rank {rank} saw its connection close"
    return f"{where} stopped responding; rank {rank} timed out waiting for it"


def _with_recorded_siblings(failures: Mapping[int, ProcessFailure]) -> dict[int, ProcessFailure]:
    """``failures`` and every other worker of the same attempt that recorded an error.

    Function workers (``start_method="forkserver"``) are reported by torch elastic one: the
    first to fail, the rest stopped; a sibling whose uncaught exception was recorded (its
    error file, ``<attempt>/<local rank>/error.json``) failed on its own too, with exit status
    1 (`parallax.launch.warm.run_script`'s for an uncaught exception). Exec'd workers are
    reported whole already, so nothing is added for them."""
    found = dict(failures)
    for rank, failure in failures.items():
        attempt = os.path.dirname(os.path.dirname(failure.error_file))
        if not os.path.isdir(attempt):
            continue
        for entry in sorted(os.listdir(attempt)):
            error_file = os.path.join(attempt, entry, "error.json")
            sibling = rank - failure.local_rank + int(entry) if entry.isdigit() else None
            if sibling is not None and sibling not in found and os.path.isfile(error_file):
                found[sibling] = ProcessFailure(local_rank=int(entry), pid=0, exitcode=1,
                                                error_file=error_file)
    return found


def _split_stopped(failures: Mapping[int, ProcessFailure]) -> tuple[list[int], list[int]]:
    """Separate ranks that failed on their own (earliest first) from ranks the agent stopped.

    The agent reports the workers it terminated as failures too (exit code -SIGTERM, no error
    file).  Error-file mtimes order failures more finely than torch's whole-second stamps.
    """
    stopped = [r for r, f in failures.items() if _was_stopped(f)]
    own = [r for r in failures if r not in stopped] or list(failures)
    # A worker killed by a signal leaves no error file, and the others' errors (connection
    # closed by peer) follow from its death: within a second, it comes first. A rank whose
    # wait saw a failed rank's connection close (LostRankError naming it) comes after that
    # rank whatever the clocks say: the agent may notice the death after the peer recorded it.
    # A rank the agent's SIGTERM ended while it was already failing (its error recorded,
    # say the same error as another rank's) is not the root cause while another failure is.
    own.sort(key=lambda r: (_lost_with(failures, r), failures[r].exitcode in _STOP_SIGNALS,
                            failures[r].timestamp, not _killed(failures[r]),
                            _error_file_mtime(failures[r]), r))
    return own, sorted(set(stopped) - set(own))


def _lost_with(failures: Mapping[int, ProcessFailure], rank: int) -> bool:
    """Whether ``rank`` failed because another failed rank's connection closed."""
    named = CULPRIT.match(_failure_summary(failures[rank]))
    return (named is not None and named.group(1) == "LostRankError"
            and int(named.group(2)) in failures and int(named.group(2)) != rank)


def _was_stopped(failure: ProcessFailure) -> bool:
    """Whether a failure looks like the agent's own termination of a healthy worker."""
    return failure.exitcode in _STOP_SIGNALS and not os.path.isfile(failure.error_file)


def _killed(failure: ProcessFailure) -> bool:
    """Whether the worker died by a signal before it could record an error."""
    return failure.exitcode < 0 and not os.path.isfile(failure.error_file)


def _error_file_mtime(failure: ProcessFailure) -> float:
    """When the worker recorded its error; infinity when it recorded none."""
    try:
        return os.stat(failure.error_file).st_mtime
    except OSError:
        return float("inf")


def _describe_exit(exitcode: int) -> str:
    """The exit code, with the signal's name when the worker was killed by one."""
    if exitcode >= 0:
        return str(exitcode)
    try:
        return f"{exitcode} ({signal.Signals(-exitcode).name})"
    except ValueError:
        return str(exitcode)


def _failure_summary(failure: ProcessFailure) -> str:
    """The recorded exception (type and message) or a hint on why there is none."""
    message = failure.message
    if isinstance(message, dict):
        message = str(message.get("message") or message.get("extraInfo", {}).get("py_callstack"))
    elif failure.exitcode > 0 and not os.path.isfile(failure.error_file):
        message = (
            "no error recorded (see the worker's output above; call "
            "parallax.launch.elastic.install_error_recorder() in the script to record exceptions)"
        )
    lines = [line for line in str(message).strip().splitlines() if line.strip()]
    summary = lines[0] if lines else "<no message>"
    if len(summary) > _SUMMARY_CHARS:
        return summary[: _SUMMARY_CHARS - 3] + "..."
    return summary if len(lines) <= 1 else f"{summary} [...]"


def _exit_status(exitcode: int) -> int:
    """A shell-style status: the exit code, or 128+N for a worker killed by signal N."""
    if exitcode > 0:
        return exitcode
    return 128 - exitcode if exitcode < 0 else 1


def install_error_recorder() -> None:
    """Record a worker's uncaught exception for the launcher's failure report.

    The exception goes to the file named by TORCHELASTIC_ERROR_FILE (set by the elastic
    agent) in torch's error-file format, then the previous hook prints it as usual.
    Calling this again is harmless.
    """
    if getattr(sys.excepthook, "_parallax_recorder", False):
        return
    handler = WholeFileErrorHandler()
    handler.initialize()
    previous = sys.excepthook

    def hook(
        exc_type: type[BaseException],
        exc: BaseException,
        tb: types.TracebackType | None,
    ) -> None:
        _record(handler, exc, tb)
        previous(exc_type, exc, tb)

    hook._parallax_recorder = True  # type: ignore[attr-defined]
    sys.excepthook = hook


class WholeFileErrorHandler(ErrorHandler):
    """torch's error handler, writing the error file whole or not at all.

    The agent parses a failed worker's error file as soon as the worker is gone, and torch
    writes it by opening (truncating) then writing: a worker the agent stopped between the two
    (its peer had failed first, as under ``sync="async"``) left an empty file, and the
    launcher died of the agent's JSONDecodeError instead of naming the failed rank. Written to
    a temporary file beside it and renamed (`parallax.atomic.replace_text`), the file is either
    absent or complete. torch's ``record_exception`` opens the file itself (it does not go
    through ``_write_error_file``), so the record is made here, in torch's format."""

    def record_exception(self, e: BaseException) -> None:
        file = self._get_error_file_path()
        if not file:
            super().record_exception(e)  # torch's: nowhere to write, so it is logged
            return
        data = {"message": {"message": f"{type(e).__name__}: {e}",
                            "extraInfo": {"py_callstack": traceback.format_exc(),
                                          "timestamp": str(int(time.time()))}}}
        self._write_error_file(file, json.dumps(data))

    def _write_error_file(self, file_path: str, error_msg: str) -> None:
        try:
            replace_text(file_path, error_msg)
        except Exception as error:  # as torch's: never let recording hide the real error
            log.warning("parallax: could not record the error in %s (%s: %s)", file_path,
                        type(error).__name__, error)


def _record(handler: ErrorHandler, exc: BaseException, tb: types.TracebackType | None) -> None:
    """Call ``record_exception`` with ``exc`` as the handled exception.

    ``record_exception`` formats the traceback from ``sys.exc_info()``, which is empty inside
    an excepthook; raising the exception again makes it current, and resetting its
    ``__traceback__`` drops the extra frame (Python 3.11+ derives exc_info from it).
    """
    try:
        raise exc
    except BaseException as current:  # recorded here, then printed by the previous hook
        current.__traceback__ = tb
        with contextlib.suppress(Exception):
            handler.record_exception(current)
