"""Faults at random moments, counted: a chaos soak of training under ``parallax run``.

    python benchmarks/chaos.py --trials 50 --kinds kill kill-save stop kill-norestart \\
        corrupt full-disk --machines 1 --nproc-per-machine 2

Each trial trains `chaos_worker.py` (EmbeddingBag + MLP, float64, Adagrad, a checkpoint every
``--checkpoint-every`` steps) and plants one fault, drawn by the trial's seed (``--seed`` +
trial index: ``--replay SEED --kinds KIND`` reruns one trial) at a random step and a random
moment inside it:

* ``kill``: SIGKILL of a random rank, ``--max-restarts 3``: the job must resume from the
  newest complete checkpoint and end with parameters equal to an uninterrupted run's (to the
  bit, or within 1e-12 of the largest value where a searched partition count changed);
* ``kill-save``: SIGKILL of a random rank while it writes a checkpoint file (saves are slowed
  by the worker's ``save_pause_s`` so that the kill lands inside one), restarts as ``kill``;
* ``kill-plan``: as ``kill``, in the first steps, while the hybrid measures α and plans
  (and, with ``--search``, while the partition count is searched: re-partitioning);
* ``link-cut``: a random machine's link down for 1 s to 0.8 x the collective timeout
  (``--machines`` >= 2 and an emulated ``--rate``), restarts as ``kill``: the job must end
  equal to the bit;
* ``kill-launcher``: SIGKILL of ``parallax run`` itself (no restarts): every worker on every
  machine must be gone within the timeout + 30 s (nothing trains on alone), and running the same
  command again must resume from the newest complete checkpoint and end equal to the bit;
* ``kill-norestart``: SIGKILL of a random rank, no restarts: the job must fail at once, the
  launcher's summary naming that rank and its signal;
* ``stop``: SIGSTOP of a random rank, no restarts: the job must fail at the collective
  timeout, naming that rank as stalled, every process gone within the timeout + 30 s;
* ``corrupt``: between two runs, a random file of the newest checkpoint truncated or one byte
  flipped: the second run must resume from an intact checkpoint and end equal to the bit;
* ``full-disk``: the checkpoint folder on a tmpfs too small for the run's checkpoints (root):
  the job must fail saying "No space left on device" and the path, the newest complete
  checkpoint still verifying.

Every trial also checks that no worker process (and no network namespace) is left behind
and that the run ended within
its limit (else it counts as hung, and the harness kills it). The record (``--out``): each
trial's kind, seed, rank, step, outcome and the end of the launcher's output; a table of
kind x trials x survived x lost x hung x culprit named is printed and written beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import records
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORKER = HERE / "chaos_worker.py"
#: must end equal to the uninterrupted run
SURVIVABLE = {"kill", "kill-save", "kill-plan", "kill-launcher", "corrupt", "link-cut"}
SAVE_PAUSE_S = 0.4  # kill-save: each checkpoint file written this long after its marker
KINDS = ("kill", "kill-save", "kill-plan", "kill-launcher", "kill-norestart", "stop", "corrupt",
         "full-disk", "link-cut")


@dataclass
class Trial:
    """One trial's fault and what came of it."""

    kind: str
    seed: int
    sync: str = "sync"
    rank: int | None = None
    step: int | None = None
    outcome: str = ""  # survived | failed-clearly | lost | hung
    checks: dict[str, bool] = field(default_factory=dict)
    seconds: float = 0.0
    after_fault_s: float | None = None  # from the fault to the launcher's exit
    exit_code: int | None = None
    detail: str = ""
    output_tail: str = ""
    namespaces_before: set[str] | None = field(default=None, repr=False)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=50, help="trials per fault kind")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--seed", type=int, default=0, help="trial i of a kind uses seed+i")
    parser.add_argument("--replay", type=int, help="run the one trial with this seed per kind")
    parser.add_argument("--machines", type=int, default=1)
    parser.add_argument("--nproc-per-machine", type=int, default=2)
    parser.add_argument("--rate", default="none",
                        help="emulated link (tc syntax; root), or none: one host's loopback")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=20.0,
                        help="Config.collective_timeout_s of the workers")
    parser.add_argument("--step-sleep", type=float, default=0.1,
                        help="seconds of 'compute' in every step (faults land inside steps)")
    parser.add_argument("--sync", choices=["sync", "async-sparse", "mixed"], default="sync",
                        help="Config.sync; async-sparse runs with max_staleness=0 (each step "
                             "applied once every worker pushed it: equal to sync); mixed: "
                             "each trial draws one of the two from its seed")
    parser.add_argument("--search", action="store_true",
                        help="the worker searches its partition count while training")
    parser.add_argument("--local-aggregation", action="store_true",
                        help="Config.local_aggregation=True in the synchronous trials: a "
                             "machine's workers merge their rows on its leader")
    parser.add_argument("--out", type=Path, default=records.scratch() / "chaos.json")
    parser.add_argument("--combine", type=Path, nargs="+", metavar="RECORD",
                        help="run nothing: join the trials of these records (sittings of one "
                             "engine: the same src/ tree, else refused) into --out and its "
                             "table")
    args = parser.parse_args(argv)
    if "link-cut" in args.kinds and (args.machines < 2 or args.rate == "none") and (
            not args.combine):
        parser.error("link-cut needs --machines >= 2 and an emulated --rate")
    if args.replay is not None:
        args.seed, args.trials = args.replay, 1
    return args


def launch(args: argparse.Namespace, out: Path, checkpoint_dir: Path, *, restarts: int,
           steps: int | None = None, save_pause: float = 0.0) -> subprocess.Popen:
    options = {"steps": steps or args.steps, "checkpoint_every": args.checkpoint_every,
               "timeout_s": args.timeout, "step_sleep_s": args.step_sleep,
               "checkpoint_dir": str(checkpoint_dir), "save_pause_s": save_pause,
               "search": args.search, "sync": args.sync,
               # asynchronous training refuses it: sync trials only (under --sync mixed)
               "local_aggregation": args.local_aggregation and args.sync == "sync"}
    network = [] if args.rate == "none" else ["--emulate-network", args.rate]
    cmd = [sys.executable, "-m", "parallax.cli", "run", "--machines", str(args.machines),
           "--nproc-per-machine", str(args.nproc_per_machine), *network,
           "--max-restarts", str(restarts), str(WORKER), str(out), json.dumps(options)]
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}"
                                       f"{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(proc: subprocess.Popen, limit: float) -> tuple[int | None, str, bool]:
    """Wait for the launcher at most ``limit`` seconds: (exit code, output, hung)."""
    try:
        output, _ = proc.communicate(timeout=limit)
        return proc.returncode, output, False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return None, output, True


def reference(args: argparse.Namespace, work: Path) -> dict[str, torch.Tensor]:
    """The uninterrupted run's final parameters (under ``args.sync``)."""
    out = work / f"reference-{args.sync}"
    out.mkdir()
    proc = launch(args, out, out / "checkpoints", restarts=0)
    code, output, hung = finish(proc, 600)
    if code != 0 or hung:
        sys.exit(f"chaos: the uninterrupted run failed (exit {code}):\n{output[-3000:]}")
    return torch.load(out / "final.pt", weights_only=True)


def alive_pids(out: Path) -> list[int]:
    """Worker processes of this trial still running (zombies excepted)."""
    alive = []
    for marker in out.glob("pid-*-*"):
        pid = int(marker.name.rsplit("-", 1)[1])
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, IndexError):
            continue
        if state != "Z":
            alive.append(pid)
    return alive


def live_pid_of(out: Path, rank: int) -> int | None:
    pids = [int(m.name.rsplit("-", 1)[1]) for m in out.glob(f"pid-{rank}-*")]
    live = [pid for pid in pids if pid in alive_pids(out)]
    return max(live) if live else None


def step_of(out: Path) -> int:
    steps = []
    for marker in out.glob("step-*"):
        try:
            steps.append(int(marker.read_text() or 0))
        except ValueError:  # being written
            continue
    return max(steps, default=0)


def wait_for(predicate: Any, proc: subprocess.Popen, limit: float, *,
             while_alive: bool = True) -> bool:
    """Whether ``predicate`` came true within ``limit`` seconds (given up when ``proc`` ends,
    unless not ``while_alive``)."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if predicate():
            return True
        if while_alive and proc.poll() is not None:
            return False
        time.sleep(0.01)
    return False


def equal(got_path: Path, want: dict[str, torch.Tensor]) -> bool:
    """Equal to the bit, or within 1e-12 of the largest value (float64): a partition count
    searched again after a restart sums a row's gradients in another order."""
    if not got_path.exists():
        return False
    got = torch.load(got_path, weights_only=True)
    return got.keys() == want.keys() and all(
        torch.equal(got[k], want[k]) or float((got[k] - want[k]).abs().max())
        <= 1e-12 * max(1.0, float(want[k].abs().max())) for k in want)


def sync_modes(args: argparse.Namespace) -> list[str]:
    return ["sync", "async-sparse"] if args.sync == "mixed" else [args.sync]


def run_trial(args: argparse.Namespace, kind: str, seed: int, work: Path,
              wants: dict[str, dict[str, torch.Tensor]], checkpoint_bytes: int) -> Trial:
    rng = random.Random(f"{kind}:{seed}")  # each kind its own draws for the same seed
    sync = rng.choice(sync_modes(args))
    args = argparse.Namespace(**{**vars(args), "sync": sync})  # this trial's
    want = wants[sync]
    trial = Trial(kind, seed, sync)
    out = work / f"{kind}-{seed}"
    out.mkdir()
    checkpoints = out / "checkpoints"
    world = args.machines * args.nproc_per_machine
    trial.rank = rng.randrange(world)
    trial.step = (rng.randint(1, 4) if kind == "kill-plan"
                  else rng.randint(2, args.steps - 3))
    began = time.monotonic()
    limit = args.timeout + 30 + 4 * args.steps * (args.step_sleep + 0.2) + 30
    mounted, fault_at = False, None
    if args.rate != "none":
        trial.namespaces_before = _namespaces()
    try:
        if kind == "corrupt":
            return _corrupt_trial(args, trial, rng, out, checkpoints, want, limit)
        if kind == "kill-launcher":
            return _kill_launcher_trial(args, trial, rng, out, checkpoints, want, limit)
        if kind == "full-disk":
            checkpoints.mkdir()
            size = int(checkpoint_bytes * rng.uniform(1.2, 2.8))
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                            str(checkpoints)], check=True)
            mounted = True
            proc = launch(args, out, checkpoints, restarts=0)
        else:
            restarts = 3 if kind in SURVIVABLE else 0
            proc = launch(args, out, checkpoints, restarts=restarts,
                          save_pause=SAVE_PAUSE_S if kind == "kill-save" else 0.0)
            fault_at = _plant(kind, trial, rng, out, proc, args)
        code, output, hung = finish(proc, limit - (time.monotonic() - began))
        trial.seconds = round(time.monotonic() - began, 2)
        if fault_at is not None:
            trial.after_fault_s = round(time.monotonic() - fault_at, 2)
        _judge(trial, code, output, hung, out, want, checkpoints, args.timeout)
    finally:
        for pid in alive_pids(out):  # the harness's own cleanup, after the count
            os.kill(pid, signal.SIGKILL)
        if mounted:
            subprocess.run(["umount", "-l", str(checkpoints)], check=False)
    return trial


def _plant(kind: str, trial: Trial, rng: random.Random, out: Path, proc: subprocess.Popen,
           args: argparse.Namespace) -> float | None:
    """Wait for the trial's moment, then send its signal to its rank; returns when (None:
    the moment never came)."""
    if kind == "kill-save":  # the first save that rank begins from the trial's step on
        marker = out / f"saving-{trial.rank}"
        if not wait_for(lambda: step_of(out) >= trial.step, proc, 120):
            trial.detail = f"step {trial.step} never reached"
            return None
        since = time.time()
        if not wait_for(lambda: marker.exists() and marker.stat().st_mtime >= since, proc, 120):
            trial.detail = "no save began"
            return None
        time.sleep(rng.uniform(0.02, 0.9 * SAVE_PAUSE_S))  # inside the pause before a write
        trial.step = step_of(out)
    else:
        if not wait_for(lambda: step_of(out) >= trial.step, proc, 120):
            trial.detail = f"step {trial.step} never reached"
            return None
        time.sleep(rng.uniform(0, args.step_sleep))
    if kind == "link-cut":
        return _cut_link(trial, rng, args)
    pid = live_pid_of(out, trial.rank)
    if pid is None:
        trial.detail = f"rank {trial.rank} not running"
        return None
    os.kill(pid, signal.SIGSTOP if kind == "stop" else signal.SIGKILL)
    return time.monotonic()


def _cut_link(trial: Trial, rng: random.Random, args: argparse.Namespace) -> float | None:
    """Take the trial's rank's machine link down (its host-side veth) for a while, in a
    thread, so that the launcher is watched meanwhile."""
    machine = trial.rank // args.nproc_per_machine
    links = [name for name in _links() if re.fullmatch(rf"px[0-9a-f]{{6}}v{machine}", name)]
    if len(links) != 1:
        trial.detail = f"no single emulated link of machine {machine}: {links}"
        return None
    seconds = rng.uniform(1.0, 0.8 * args.timeout)
    trial.detail = f"machine {machine}'s link down {seconds:.1f} s"

    def cut() -> None:
        subprocess.run(["ip", "link", "set", links[0], "down"], check=False)
        time.sleep(seconds)
        subprocess.run(["ip", "link", "set", links[0], "up"], check=False)

    threading.Thread(target=cut, daemon=True).start()
    return time.monotonic()


def _links() -> list[str]:
    listing = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True)
    return [line.split(":")[1].strip().split("@")[0] for line in listing.stdout.splitlines()]


def _namespaces() -> set[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return {line.split()[0] for line in listing.stdout.splitlines() if line.startswith("px")}


def _corrupt_trial(args: argparse.Namespace, trial: Trial, rng: random.Random, out: Path,
                   checkpoints: Path, want: dict[str, torch.Tensor], limit: float) -> Trial:
    """Train to the trial's step rounded up to a checkpoint, damage the newest checkpoint,
    then train to the end from what is left."""
    began = time.monotonic()
    first = -(-trial.step // args.checkpoint_every) * args.checkpoint_every
    code, output, hung = finish(launch(args, out, checkpoints, restarts=0, steps=first), limit)
    if code != 0 or hung:
        trial.outcome, trial.detail = "lost", f"the first run failed (exit {code})"
        trial.output_tail = output[-2000:]
        return trial
    (out / "final.pt").unlink()
    newest = max(checkpoints.glob("step-*"))
    victim = rng.choice(sorted(p for p in newest.iterdir() if p.is_file()))
    data = bytearray(victim.read_bytes())
    if rng.random() < 0.5 and len(data) > 1:
        cut = rng.randrange(len(data))
        victim.write_bytes(bytes(data[:cut]))
        trial.detail = f"{victim.relative_to(checkpoints)} truncated to {cut} bytes"
    else:
        at = rng.randrange(len(data))
        data[at] ^= 1 << rng.randrange(8)
        victim.write_bytes(bytes(data))
        trial.detail = f"{victim.relative_to(checkpoints)}: a bit of byte {at} flipped"
    code, output, hung = finish(launch(args, out, checkpoints, restarts=0), limit)
    trial.seconds = round(time.monotonic() - began, 2)
    detail, trial.detail = trial.detail, ""
    _judge(trial, code, output, hung, out, want, checkpoints, args.timeout)
    trial.detail = f"{detail}; {trial.detail}".strip("; ")
    return trial


def _kill_launcher_trial(args: argparse.Namespace, trial: Trial, rng: random.Random, out: Path,
                         checkpoints: Path, want: dict[str, torch.Tensor],
                         limit: float) -> Trial:
    """SIGKILL ``parallax run`` at the trial's moment; every worker must end on its own within
    the timeout + 30 s; then the same command again, which must end equal to the bit."""
    began = time.monotonic()
    proc = launch(args, out, checkpoints, restarts=0)
    if not wait_for(lambda: step_of(out) >= trial.step, proc, 120):
        trial.detail = f"step {trial.step} never reached"
    else:
        time.sleep(rng.uniform(0, args.step_sleep))
        proc.kill()
    killed_at, killed_step = time.monotonic(), step_of(out)
    gone = wait_for(lambda: not alive_pids(out), proc, args.timeout + 30, while_alive=False)
    trial.after_fault_s = round(time.monotonic() - killed_at, 2)
    # a step in flight may end; an agent that trained on without its launcher would go on
    stopped = step_of(out) <= killed_step + 2
    first_output = proc.communicate()[0] if gone else ""
    for pid in alive_pids(out):  # counted below; the rerun needs its machines to itself
        os.kill(pid, signal.SIGKILL)
    (out / "final.pt").unlink(missing_ok=True)
    code, output, hung = finish(launch(args, out, checkpoints, restarts=0), limit)
    trial.seconds = round(time.monotonic() - began, 2)
    _judge(trial, code, first_output + output, hung, out, want, checkpoints, args.timeout)
    trial.checks["every worker gone within timeout + 30 s of the launcher's kill"] = gone
    trial.checks["training stopped with the launcher"] = stopped
    if not (gone and stopped) and trial.outcome != "hung":
        trial.outcome = "lost"
        trial.detail = (f"workers outlived the launcher (step {killed_step} at the kill, "
                        f"{step_of(out)} after); " + trial.detail)
    return trial


def _judge(trial: Trial, code: int | None, output: str, hung: bool, out: Path,
           want: dict[str, torch.Tensor], checkpoints: Path, timeout: float = 0.0) -> None:
    from parallax.checkpoint.files import newest_complete

    trial.exit_code = code
    trial.output_tail = output[-2500:]
    time.sleep(0.5)  # the launcher is gone: its workers must be too
    left = alive_pids(out)
    # the launcher's summary: a line per failed rank, the root cause first
    summary = [line for line in output.splitlines()
               if re.match(r"parallax: rank \d+ \(machine \d+\) ", line)]
    culprit = f"parallax: rank {trial.rank} "
    checks = {"no process left": not left, "not hung": not hung}
    if trial.namespaces_before is not None:
        checks["no namespace left"] = not (_namespaces() - trial.namespaces_before)
    if trial.kind in SURVIVABLE:
        checks["equal to the uninterrupted run"] = code == 0 and equal(out / "final.pt", want)
    elif trial.kind == "kill-norestart":
        checks["exit status of SIGKILL (137)"] = code == 128 + signal.SIGKILL
        checks["culprit named"] = bool(summary) and summary[0].startswith(culprit) and (
            "signal 9" in summary[0] or "SIGKILL" in summary[0])
        checks["said crashed, not hung"] = "stopped responding" not in output
    elif trial.kind == "stop":
        checks["failed"] = code not in (0, None)
        checks["ended within timeout + 30 s"] = (trial.after_fault_s is not None
                                                and trial.after_fault_s <= timeout + 30)
        checks["culprit named"] = bool(summary) and summary[0].startswith(culprit) and (
            "stopped responding" in summary[0])
    elif trial.kind == "full-disk":
        checks["failed"] = code not in (0, None)
        checks["culprit named"] = ("No space left on device" in output
                                   and str(checkpoints) in output)
        newest = newest_complete(checkpoints)
        checks["newest complete checkpoint verifies"] = (
            newest is None or newest_complete(checkpoints, verify=True) == newest)
    trial.checks = checks
    if hung:
        trial.outcome = "hung"
    elif all(checks.values()):
        trial.outcome = "survived" if trial.kind in SURVIVABLE else "failed-clearly"
    else:
        trial.outcome = "lost"
        trial.detail = ", ".join(name for name, ok in checks.items() if not ok) + " failed"
    if left:
        trial.detail += f"; left behind: pids {left}"


def table(trials: list[Trial]) -> str:
    lines = ["| fault | trials (async-sparse) | survived | failed clearly | lost | hung | "
             "culprit named |", "|---|---|---|---|---|---|---|"]
    for kind in dict.fromkeys(t.kind for t in trials):
        mine = [t for t in trials if t.kind == kind]
        count = {o: sum(t.outcome == o for t in mine)
                 for o in ("survived", "failed-clearly", "lost", "hung")}
        named = [t for t in mine if "culprit named" in t.checks]
        culprit = (f"{sum(t.checks['culprit named'] for t in named)}/{len(named)}"
                   if named else "–")
        asynchronous = sum(t.sync != "sync" for t in mine)
        lines.append(f"| {kind} | {len(mine)} ({asynchronous}) | {count['survived']} | "
                     f"{count['failed-clearly']} | {count['lost']} | {count['hung']} | "
                     f"{culprit} |")
    return "\n".join(lines)


def combine(records: list[Path], out: Path) -> int:
    """`--combine`: the trials of ``records`` as one record at ``out`` (the same engine)."""
    loaded = [json.loads(path.read_text()) for path in records]
    trees = {record.get("code", {}).get("src_tree") for record in loaded}
    if len(trees) != 1 or None in trees or any(
            record["code"].get("src_modified") != "False" for record in loaded):
        sys.exit("chaos: the records ran different (or modified) engines: "
                 f"{sorted(map(str, trees))}")
    fields = {f.name for f in Trial.__dataclass_fields__.values()}
    trials = [Trial(**{k: v for k, v in t.items() if k in fields})
              for record in loaded for t in record["trials"]]
    text = table(trials)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"combined": [str(path) for path in records],
                               "code": loaded[0]["code"],
                               "settings": [record["settings"] for record in loaded],
                               "trials": [asdict(t) for t in trials]}, indent=1))
    out.with_suffix(".md").write_text(text + "\n")
    print(text)
    return 0 if all(t.outcome in ("survived", "failed-clearly") for t in trials) else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.combine:
        return combine(args.combine, args.out)
    if "full-disk" in args.kinds and os.geteuid() != 0:
        sys.exit("chaos: the full-disk fault mounts a tmpfs: run as root, or leave it out")
    work = Path(tempfile.mkdtemp(prefix="parallax-chaos-"))
    trials: list[Trial] = []
    try:
        wants = {mode: reference(argparse.Namespace(**{**vars(args), "sync": mode}), work)
                 for mode in sync_modes(args)}
        first = work / f"reference-{sync_modes(args)[0]}" / "checkpoints"
        checkpoint_bytes = sum(f.stat().st_size for f in max(first.glob("step-*")).iterdir())
        for i in range(args.trials):
            for kind in args.kinds:
                trial = run_trial(args, kind, args.seed + i, work, wants, checkpoint_bytes)
                trials.append(trial)
                print(f"chaos: {kind} seed {trial.seed} ({trial.sync}) rank {trial.rank} step "
                      f"{trial.step}: {trial.outcome} in {trial.seconds:.1f} s {trial.detail}",
                      flush=True)
                write_record(args, trials)  # after every trial: a soak cut short keeps its count
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(write_record(args, trials))
    return 0 if all(t.outcome in ("survived", "failed-clearly") for t in trials) else 1


def code_version() -> dict[str, str]:
    """The commit the soak ran, and the tree of its ``src/`` (sittings of one engine can be
    counted together: the same tree, whatever else the commits changed)."""
    def git(*argv: str) -> str:
        proc = subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True)
        return proc.stdout.strip() or "unknown"
    dirty = git("status", "--porcelain", "--", "src") not in ("", "unknown")
    return {"commit": git("rev-parse", "HEAD"), "src_tree": git("rev-parse", "HEAD:src"),
            "src_modified": str(dirty)}


def write_record(args: argparse.Namespace, trials: list[Trial]) -> str:
    """Write the trials so far (``--out``) and their table beside it; returns the table."""
    text = table(trials)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"settings": {k: str(v) if isinstance(v, Path) else v
                           for k, v in vars(args).items()},
              "code": code_version(),
              "trials": [{k: v for k, v in asdict(t).items() if k != "namespaces_before"}
                         for t in trials]}
    args.out.write_text(json.dumps(record, indent=1))
    args.out.with_suffix(".md").write_text(text + "\n")
    return text


if __name__ == "__main__":
    sys.exit(main())
