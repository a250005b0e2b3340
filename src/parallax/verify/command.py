"""``parallax verify``: run the program as the reference and distributed, compare, report.

Each run is a child process (its output goes to a log file, shown when it fails), stopped
after ``timeout_s`` with its whole process group. The exit status: 0 when every parameter and
buffer stayed within the tolerance at every step, 1 when something differs, 2 when a run
failed or the arguments are wrong.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from parallax.verify.compare import Comparison, compare_runs, recorded_steps
from parallax.verify.record import VERIFY_ENV, Verification, extra_models, model_folder

__all__ = ["VerifyOptions", "compare_models", "report", "verify"]

DIFFERENT = 1
FAILED = 2
# A launch's identity: the reference must not believe it is one of an outer job's workers.
_LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                     "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR",
                     "MASTER_PORT", "TORCHELASTIC_RUN_ID", "PARALLAX_RESOURCES")
_CHILD = Path(__file__).with_name("child.py")


@dataclass
class VerifyOptions:
    """What ``parallax verify`` runs and how it judges."""

    script: str
    script_args: list[str] = field(default_factory=list)
    machines: int = 2
    nproc_per_machine: int = 1
    steps: int = 20
    tolerance: float | None = None  # None: 1e-9 in float64, 1e-5 in the program's dtype
    float64: bool = True  # run the program with torch's default dtype float64
    timeout_s: float = 600.0  # per run
    keep: str | None = None  # keep the recorded states here
    json_path: str | None = None  # also write the comparison here
    # the program before the port (script and arguments) as the reference, not the port
    reference: list[str] | None = None

    @property
    def workers(self) -> int:
        return self.machines * self.nproc_per_machine

    @property
    def limit(self) -> float:
        if self.tolerance is not None:
            return self.tolerance
        return 1e-9 if self.float64 else 1e-5


@dataclass
class _RunResult:
    code: int | None  # None: timed out
    seconds: float
    log: Path


def verify(options: VerifyOptions) -> int:
    """Run, compare, print the report; the exit status."""
    with tempfile.TemporaryDirectory(prefix="parallax-verify-") as scratch:
        root = Path(options.keep) if options.keep else Path(scratch)
        root.mkdir(parents=True, exist_ok=True)
        runs = {}
        for role in ("reference", "distributed"):
            _say(f"{role} run: {_describe(options, role)} ...")
            result = _run(options, role, root)
            if result.code != 0:
                return _failed(role, result, options)
            if recorded_steps(root / role) < 0:
                print(f"parallax verify: {options.script} ended without calling "
                      f"parallax.distribute or parallax.get_runner: nothing to compare",
                      file=sys.stderr)
                return FAILED
            _say(f"{role} run: {recorded_steps(root / role)} steps in {result.seconds:.1f} s")
            runs[role] = result
        comparisons = compare_models(root / "reference", root / "distributed", options.limit)
        print("\n".join(report(comparison, options, model=number)
                        for number, comparison in comparisons.items()), flush=True)
        equal = all(comparison.equal for comparison in comparisons.values())
        if options.json_path:
            record = json.loads(comparisons[1].to_json())
            record["models"] = [{"model": number, **json.loads(comparison.to_json())}
                                for number, comparison in list(comparisons.items())[1:]]
            record["all_equal"] = equal
            Path(options.json_path).write_text(json.dumps(record, indent=2))
        if options.keep:
            _say(f"recorded states kept in {root}")
        return 0 if equal else DIFFERENT


def compare_models(reference: Path, distributed: Path,
                   tolerance: float) -> dict[int, Comparison]:
    """Each model the program trained (1: its first `parallax.distribute` or
    `parallax.get_runner`; 2, 3, ...: the further ones, `record.model_folder`), compared;
    a model only one run recorded compares as not recorded by the other."""
    numbers = sorted({*extra_models(reference), *extra_models(distributed)})
    comparisons = {1: compare_runs(reference, distributed, tolerance)}
    for number in numbers:
        comparison = compare_runs(model_folder(reference, number),
                                  model_folder(distributed, number), tolerance)
        # the run's description is the first model's folder's (one run, one description)
        comparison.reference_kind = comparisons[1].reference_kind
        comparison.hints = comparisons[1].hints
        comparisons[number] = comparison
    return comparisons


def _describe(options: VerifyOptions, role: str) -> str:
    dtype = "float64" if options.float64 else "the program's dtype"
    if role == "reference" and options.reference:
        return (f"the original program {' '.join(options.reference)} in one process, each "
                f"DataLoader {options.workers} x its batch_size, {dtype}, {options.steps} steps")
    if role == "reference":
        return (f"one process, the global batch ({options.workers} x the loader's), {dtype}, "
                f"{options.steps} steps")
    return (f"{options.machines} machine(s) x {options.nproc_per_machine} worker(s), {dtype}, "
            f"{options.steps} steps")


def _run(options: VerifyOptions, role: str, root: Path) -> _RunResult:
    directory = root / role
    shutil.rmtree(directory, ignore_errors=True)  # a kept earlier run's states
    directory.mkdir(parents=True)
    original = role == "reference" and options.reference is not None
    verification = Verification(str(directory), "original" if original else role,
                                options.steps, options.workers, options.float64)
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARIABLES}
    env[VERIFY_ENV] = verification.to_env()
    program = options.reference if original and options.reference else [
        options.script, *options.script_args]
    script = [str(_CHILD), *program]
    if role == "reference":
        from parallax.cluster import free_port

        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                   GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        command = [sys.executable, "-u", *script]
    else:
        command = [sys.executable, "-m", "parallax.cli", "run", "--machines",
                   str(options.machines), "--nproc-per-machine", str(options.nproc_per_machine),
                   *script]
    log = root / f"{role}.log"
    began = time.monotonic()
    with open(log, "w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            code = _wait(process, directory, options, role)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    return _RunResult(code, time.monotonic() - began, log)


def _wait(process: subprocess.Popen[bytes], directory: Path, options: VerifyOptions,
          role: str) -> int | None:
    """The run's exit status (None: past the timeout), with its progress: on a terminal
    as it goes, elsewhere a line every 30 s."""
    deadline = time.monotonic() + options.timeout_s
    live = sys.stderr.isatty()
    said = time.monotonic()
    while True:
        try:
            code = process.wait(timeout=1.0)
            break
        except subprocess.TimeoutExpired:
            now = time.monotonic()
            if now > deadline:
                return None
            done = max(recorded_steps(directory), 0)
            if live:
                print(f"\rparallax verify: {role} step {done}/{options.steps}", end="",
                      file=sys.stderr, flush=True)
            elif now - said >= 30:
                _say(f"{role} run: step {done}/{options.steps}")
                said = now
    if live:
        print("\r\033[K", end="", file=sys.stderr, flush=True)
    return code


def _failed(role: str, result: _RunResult, options: VerifyOptions) -> int:
    why = (f"did not end within {options.timeout_s:g} s (--timeout)" if result.code is None
           else f"failed (exit status {result.code})")
    tail = result.log.read_text(errors="replace").splitlines()[-30:]
    print(f"parallax verify: the {role} run of {options.script} {why}; its last lines:",
          file=sys.stderr)
    for line in tail:
        print(f"  | {line}", file=sys.stderr)
    if options.float64 and role == "reference":
        print("parallax verify: if the program cannot run in float64 (float32 data, a "
              "dtype it sets), verify it in its own dtype with --dtype program",
              file=sys.stderr)
    return FAILED


def report(comparison: Comparison, options: VerifyOptions, *, model: int = 1) -> str:
    """The per-tensor table and the verdict (of the program's ``model``-th model: its
    ``model``-th `parallax.distribute` or `parallax.get_runner`)."""
    command = " ".join([options.script, *options.script_args])
    which = ("" if model == 1 else f", model {model} (the program's call {model} of "
             f"parallax.distribute or parallax.get_runner)")
    against = ("the original program " + " ".join(options.reference) if options.reference
               else "the program")
    lines = [f"parallax verify: {command}{which}",
             f"  {options.machines} machine(s) x {options.nproc_per_machine} worker(s) against "
             f"{against} in one process with the global batch, "
             f"{_dtypes_said(comparison, options)}, "
             f"{comparison.steps} step(s) compared (step 0: before training)",
             f"  reference: {comparison.reference_kind or 'unknown'}"]
    width = max([len("tensor"), *(len(t.name) for t in comparison.tensors)])
    lines.append(f"  {'tensor':<{width}}  max |difference|  at step  first step above "
                 f"{comparison.tolerance:g}")
    for t in comparison.tensors:
        first = "-" if t.first_step_above is None else str(t.first_step_above)
        lines.append(f"  {t.name:<{width}}  {t.max_difference:>16.3e}  {t.at_step:>7}  {first}")
    for name in comparison.only_in_reference:
        lines.append(f"  {name}: only in the reference run's state")
    for name in comparison.only_in_distributed:
        lines.append(f"  {name}: only in the distributed run's state")
    for text in comparison.shape_mismatches:
        lines.append(f"  shapes differ: {text}")
    lines.append(_verdict(comparison))
    if not comparison.equal:
        rounding = _float32_rounding(comparison, options)
        if rounding:
            lines.append(f"hint: {rounding}")
        elif any(t.first_step_above == 0 for t in comparison.above):
            lines.append("hint: the runs start from different values: seed torch's generator "
                         "(torch.manual_seed) before building the model, so that every run "
                         "of the program starts from the same one")
        elif (comparison.above and comparison.above[0].first_step_above == 1
              and not comparison.hints and not rounding):  # no named cause (dropout, ...)
            lines.append(f"hint: {_BATCH_COUPLED}")
        lines += [f"hint: {hint}" for hint in comparison.hints]
    return "\n".join(lines)


def _dtypes_said(comparison: Comparison, options: VerifyOptions) -> str:
    """The dtypes the states really had (a program that builds its own float32 tensors, from
    numpy arrays say, stays float32 under --dtype float64)."""
    had = " and ".join(comparison.dtypes) or "no floating"
    if options.float64 and comparison.dtypes and comparison.dtypes != ["float64"]:
        return f"states in {had} (asked: float64; the program builds these itself)"
    return f"states in {had}" if comparison.dtypes else "float64" if options.float64 else \
        "the program dtype"


def _float32_rounding(comparison: Comparison, options: VerifyOptions) -> str:
    """A hint when every difference is within the rounding of lower-precision states that
    the float64 tolerance cannot take: the runs agree to that precision."""
    low = [d for d in comparison.dtypes if d in ("float32", "float16", "bfloat16")]
    if not low or not comparison.above or options.tolerance is not None:
        return ""
    scale = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 1e-2}[low[-1]]
    if max(t.max_difference for t in comparison.above) > scale:
        return ""
    return (f"the states are {' and '.join(low)} (the program builds them so: torch's "
            f"default dtype does not reach tensors made from numpy arrays or with an explicit "
            f"dtype), and every difference is within {low[-1]}'s rounding of a different "
            f"summation order (at most {max(t.max_difference for t in comparison.above):.1e}"
            f"): compare with --tolerance {scale:g}, or build the program's tensors in float64 "
            f"to verify to 1e-9")


# The first update differs with nothing else to blame: the likeliest cause is a computation
# across the samples of a batch, which each worker does over its part only.
_BATCH_COUPLED = (
    "the very first update differs: if the loss or the model combines the samples of a batch "
    "with each other (in-batch negatives, a softmax or a normalisation over the batch, a "
    "mean over a count of the batch such as a mask's), each worker computes it over its own "
    "part, as under DDP, not over the global batch; divide a sum by the global count with "
    "parallax.global_mean(total, count), and gather what crosses samples from every worker "
    "with an all_gather that keeps the gradient (torch.distributed._functional_collectives."
    "all_gather_single_autograd) to train exactly")


def _verdict(comparison: Comparison) -> str:
    if comparison.steps == 0:
        return "NOTHING COMPARED: the program ended before its first optimizer step"
    if comparison.reference_steps != comparison.distributed_steps:
        return (f"DIFFERENT: the reference run took {comparison.reference_steps} step(s), the "
                f"distributed run {comparison.distributed_steps} (the program ended earlier in "
                f"one of them)")
    above = comparison.above
    if above:
        first = above[0]
        when = ("before training (the initial values)" if first.first_step_above == 0
                else f"at step {first.first_step_above}")
        return (f"DIFFERENT: {len(above)} of {len(comparison.tensors)} tensors went above "
                f"{comparison.tolerance:g}; the first {when}: {first.name} (largest "
                f"{first.max_difference:.3e} at step {first.at_step})")
    if not comparison.equal:
        return "DIFFERENT: the two runs' states do not hold the same tensors"
    return (f"EQUAL: every parameter and buffer within {comparison.tolerance:g} of the "
            f"one-process run at each of {comparison.steps} step(s)")


def _say(text: str) -> None:
    print(f"parallax verify: {text}", file=sys.stderr, flush=True)
