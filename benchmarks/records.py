"""The benchmark records: one file per measurement, named by experiment, commit and host, and
never overwritten.

A record is ``benchmarks/records/<experiment>/<commit7>-<host>[-<n>].json``::

    {"format": "parallax-record/1", "experiment": "compare-lm-4x1-1gbit",
     "bench": "lm-4x1",                      # the scripts/bench.sh experiment, when it ran one
     "provenance": {"commit", "tree", "diff_sha256", "command", "host": {"cpu", "cores",
                    "load", "python", "torch"}, "finished"},
     "seeds": [...] | null,                  # the command's seeds (null: the script's fixed one)
     "payload": <what the script wrote: its rounds, every one of them>}

``tree`` is ``"clean"`` or ``"dirty"`` (uncommitted changes to tracked files outside this
store), and ``diff_sha256`` the hash of ``git diff HEAD`` then, so two dirty runs of one commit
can be told apart. A second record of the same experiment, commit and host gets ``-2``, ``-3``:
files are opened with ``"x"`` (exclusive creation), so nothing here can replace a record.
Companion files the script wrote beside its JSON (``.md`` tables, profile directories) go next
to the record under the same name.

Records moved here from the old ``benchmarks/results/`` store carry ``legacy`` (the path they
had and the commit that committed them); their provenance holds what the old record said and
null where it said nothing. Every version of an old record that git kept became a record of its
own: the old store overwrote some.

Scripts write their outputs to a scratch directory (``scratch()``: ``benchmarks/out/``, not
committed, or ``$PARALLAX_BENCH_OUT``); ``scripts/bench.sh`` then files them::

    python benchmarks/records.py add lm-4x1 benchmarks/out/lm-4x1 --command "compare.py ..."
    python benchmarks/records.py list [EXPERIMENT]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
STORE = HERE / "records"
FORMAT = "parallax-record/1"
SCRATCH_ENV = "PARALLAX_BENCH_OUT"
IMAGES = (".png", ".svg", ".pdf")


def scratch() -> Path:
    """Where a benchmark script writes its outputs by default (not a record until filed)."""
    return Path(os.environ.get(SCRATCH_ENV, HERE / "out"))


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def host() -> dict[str, Any]:
    """The machine a measurement ran on: CPU model, cores, load average, versions."""
    try:
        import torch
        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    return {"cpu": _cpu_model(), "cores": os.cpu_count(),
            "load": [round(x, 2) for x in os.getloadavg()],
            "python": platform.python_version(), "torch": torch_version}


def provenance(command: list[str] | None = None) -> dict[str, Any]:
    """What produced a result: the commit, the tree's state (clean, or dirty with the diff's
    hash; this store and the scratch directory excluded), the exact command, the host, the
    time it finished. ``dirty`` is kept for the readers of the older records."""
    outside = ["--", ".", ":(exclude)benchmarks/records", ":(exclude)benchmarks/results"]
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no", *outside))
    diff = _git("diff", "HEAD", *outside) if dirty else ""
    argv = command if command is not None else [Path(sys.argv[0]).name or "python",
                                                *sys.argv[1:]]
    return {"commit": _git("rev-parse", "HEAD") or None,
            "tree": "dirty" if dirty else "clean", "dirty": dirty,
            "diff_sha256": hashlib.sha256(diff.encode()).hexdigest() if dirty else None,
            "command": " ".join(argv), "host": host(),
            "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def host_slug(host_info: dict[str, Any] | None) -> str:
    """A file-name word for a host: its CPU family and cores (``amd-epyc-2c``)."""
    if not host_info or not host_info.get("cpu"):
        return "host-unrecorded"
    cpu = str(host_info["cpu"]).lower()
    for vendor in ("amd", "intel", "nvidia", "apple", "arm"):
        cpu = cpu.replace(f"{vendor}(r)", vendor)
    words = [w for w in re.split(r"[^a-z0-9]+", cpu)
             if w and w not in {"r", "tm", "processor", "cpu", "core"}][:2]
    cores = host_info.get("cores")
    return "-".join(words) + (f"-{cores}c" if cores else "")


@dataclass(frozen=True)
class Record:
    """One filed record, read back."""

    path: Path
    data: dict[str, Any]

    @property
    def experiment(self) -> str:
        return str(self.data["experiment"])

    @property
    def payload(self) -> Any:
        return self.data["payload"]

    @property
    def name(self) -> str:
        """The record's id: ``<experiment>/<file stem>``."""
        return f"{self.path.parent.name}/{self.path.stem}"


def new_path(experiment: str, commit: str | None, host_info: dict[str, Any] | None,
             store: Path = STORE, suffix: str = ".json") -> Path:
    """The first free ``<experiment>/<commit7>-<host>[-n]`` name in ``store``."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.+-]*", experiment):
        raise ValueError(f"experiment name {experiment!r}: letters, digits and ._+- only")
    base = f"{(commit or 'unknown')[:7]}-{host_slug(host_info)}"
    directory = store / experiment
    n = 1
    while True:
        stem = base if n == 1 else f"{base}-{n}"
        if not any(directory.glob(f"{stem}.*")) and not (directory / stem).exists():
            return directory / f"{stem}{suffix}"
        n += 1


def write(experiment: str, payload: Any, *, source: dict[str, Any] | None = None,
          seeds: list[int] | None = None, bench: str | None = None,
          legacy: dict[str, Any] | None = None, store: Path = STORE) -> Path:
    """File ``payload`` as a new record of ``experiment``; returns its path. Never replaces a
    file: a name already taken gets the next number, and the file is created exclusively."""
    source = source or provenance()
    record: dict[str, Any] = {"format": FORMAT, "experiment": experiment, "bench": bench,
                              "provenance": source, "seeds": seeds, "payload": payload}
    if legacy is not None:
        record["legacy"] = legacy
    while True:
        path = new_path(experiment, source.get("commit"), source.get("host"), store)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with path.open("x") as handle:
                json.dump(record, handle, indent=1)
                handle.write("\n")
            return path
        except FileExistsError:  # another writer took the name between the check and here
            continue


def load(path: Path) -> Record:
    """A record read back; refuses a file that is not one."""
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path}: not a benchmark record (no format {FORMAT!r})")
    return Record(path, data)


def read(path: Path) -> Any:
    """What a JSON file holds: a record's payload, or a script's raw output as it is."""
    data = json.loads(path.read_text())
    if isinstance(data, dict) and data.get("format") == FORMAT:
        return data["payload"]
    return data


def newest(experiment: str, store: Path = STORE) -> Path:
    """The most recently finished record of ``experiment`` (by its provenance's time)."""
    found = list(records(experiment, store))
    if not found:
        raise FileNotFoundError(f"no record of {experiment!r} in {store}: "
                                f"bash scripts/bench.sh makes one")
    return max(found, key=lambda r: str((r.data["provenance"] or {}).get("finished") or
                                        "")).path


def records(experiment: str | None = None, store: Path = STORE) -> Iterator[Record]:
    """Every record (of one experiment), in name order, a name's numbered copies after it."""
    pattern = f"{experiment}/*.json" if experiment else "*/*.json"
    for path in sorted(store.glob(pattern), key=_order):
        yield load(path)


def _order(path: Path) -> tuple[str, str, int]:
    """A record's place: by experiment, name, then its number (``-2`` after the first)."""
    match = re.fullmatch(r"(.*?)(?:-(\d+))?", path.stem)
    assert match is not None
    return (path.parent.name, match.group(1), int(match.group(2) or 1))


def _payload_provenance(payload: Any) -> dict[str, Any] | None:
    """The provenance a script wrote into its own output, if any (the first one found)."""
    if isinstance(payload, dict):
        if isinstance(payload.get("provenance"), dict):
            return payload["provenance"]
        if "commit" in payload and ("host" in payload or "dirty" in payload):
            return payload
        values: list[Any] = list(payload.values())
    elif isinstance(payload, list):
        values = payload
    else:
        return None
    for value in values:
        if isinstance(value, dict | list):
            found = _payload_provenance(value)
            if found:
                return found
    return None


def seeds_of(command: str) -> list[int] | None:
    """The seeds a command line names (``--seed N``, ``--seeds N M``), or None."""
    words = command.split()
    seeds: list[int] = []
    for i, word in enumerate(words):
        if word in ("--seed", "--seeds"):
            for value in words[i + 1:]:
                if not value.lstrip("-").isdigit():
                    break
                seeds.append(int(value))
    return seeds or None


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def add(bench: str, directory: Path, command: str, store: Path = STORE) -> list[Path]:
    """File every JSON output in ``directory`` as a record (its experiment: the file's stem),
    with its companions of the same stem (``.md``), and every directory (profiles) as a
    record directory of its own; refuses outputs measured at another commit."""
    now = provenance(command.split())
    outputs = {output: json.loads(output.read_text())
               for output in sorted(directory.glob("*.json"))}
    for output, payload in outputs.items():  # all checked before any is filed
        own = _payload_provenance(payload)
        if own and own.get("commit") and now["commit"] and own["commit"] != now["commit"]:
            raise SystemExit(f"{output}: measured at {own['commit'][:7]}, the tree is at "
                             f"{now['commit'][:7]}: file it from a checkout of that commit")
    filed: list[Path] = []
    for output, payload in outputs.items():
        path = write(output.stem, payload, source=now, seeds=seeds_of(command), bench=bench,
                     store=store)
        for companion in sorted(directory.glob(f"{output.stem}.*")):
            # tables and logs travel with the record; figures are copied to benchmarks/figures
            if companion != output and companion.is_file() and companion.suffix not in IMAGES:
                shutil.copyfile(companion, path.with_suffix(companion.suffix))
        filed.append(path)
        print(f"[records] {output.name} -> {_shown(path)}", flush=True)
    for output in sorted(directory.iterdir()):  # profiles and traces: a directory each
        if output.is_dir() and not output.name.endswith("-runs"):
            path = new_path(output.name, now["commit"], now["host"], store, suffix="")
            shutil.copytree(output, path)
            filed.append(path)
            print(f"[records] {output.name}/ -> {_shown(path)}/", flush=True)
    return filed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="action", required=True)
    adding = commands.add_parser("add", help="file a scratch directory's outputs")
    adding.add_argument("bench", help="the scripts/bench.sh experiment that wrote them")
    adding.add_argument("directory", type=Path)
    adding.add_argument("--command", required=True, help="the command that wrote them")
    listing = commands.add_parser("list", help="the records (of one experiment)")
    listing.add_argument("experiment", nargs="?")
    args = parser.parse_args()
    if args.action == "add":
        if not add(args.bench, args.directory, args.command):
            raise SystemExit(f"{args.directory}: no JSON output to file")
    else:
        for record in records(args.experiment):
            source = record.data["provenance"] or {}
            print(f"{record.name:70s} {source.get('tree') or '?':6s} "
                  f"{source.get('finished') or ''}")


if __name__ == "__main__":
    main()
