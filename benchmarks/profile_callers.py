"""Which Python lines make the host wait for the device: the host synchronisations of a
torch.profiler Chrome trace, counted by the Python frames that enclose them.

Why read the trace rather than the profiler's events: on the H200 (torch 2.11, CUDA 13) neither
``FunctionEvent.stack`` nor the ``cpu_parent`` chain named a single Python frame for any
synchronisation (runs 4 and 6), while the exported trace holds every ``python_function`` span
(``with_stack=True``) with its thread and times. A frame encloses an operator when it runs on
the same thread and its span covers the operator's; the innermost frames outside torch's own
files are the lines worth reading.

    python benchmarks/profile_callers.py TRACE.json   # the table, most frequent first
"""

from __future__ import annotations

import bisect
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

#: the operators that make the host wait for the device
HOST_SYNCS = ("aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize")

#: frames that say nothing about the caller: torch's own files, builtins, context managers
NOT_CALLERS = ("torch/", "<built-in", "contextlib.py", "threading.py")


def _python_spans(events: list[dict[str, Any]]) -> dict[Any, list[dict[str, Any]]]:
    """Each thread's Python function spans, by start time."""
    spans: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for event in events:
        if event.get("cat") == "python_function" and event.get("ph") == "X":
            spans[event["tid"]].append(event)
    for thread in spans.values():
        thread.sort(key=lambda span: span["ts"])
    return spans


def callers_of(events: list[dict[str, Any]], names: tuple[str, ...] = HOST_SYNCS,
               depth: int = 4) -> Counter[tuple[str, str]]:
    """How often each operator in ``names`` ran under each chain of enclosing Python frames
    (innermost first, ``depth`` at most, torch's own frames left out)."""
    spans = _python_spans(events)
    starts = {tid: [span["ts"] for span in thread] for tid, thread in spans.items()}
    counts: Counter[tuple[str, str]] = Counter()
    for event in events:
        if event.get("name") not in names or event.get("ph") != "X":
            continue
        thread = spans.get(event["tid"], [])
        end = event["ts"] + event.get("dur", 0)
        opened = thread[:bisect.bisect_right(starts.get(event["tid"], []), event["ts"])]
        enclosing = [span for span in reversed(opened) if span["ts"] + span["dur"] >= end]
        frames = [span["name"] for span in enclosing
                  if not any(skip in span["name"] for skip in NOT_CALLERS)]
        counts[(event["name"], " <- ".join(frames[:depth]))] += 1
    return counts


def trace_events(path: Path) -> list[dict[str, Any]]:
    """The events of a Chrome trace written by ``profile.export_chrome_trace``."""
    trace = json.loads(path.read_text())
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def report(counts: Counter[tuple[str, str]], steps: int | None = None) -> str:
    """One line per (operator, callers), most frequent first; per step where ``steps`` is given."""
    lines = []
    for (name, callers), count in counts.most_common():
        per_step = f"  ({count / steps:g}/step)" if steps else ""
        lines.append(f"{count:6d}{per_step}  {name}  <- {callers or '(no Python frame)'}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    print(report(callers_of(trace_events(Path(argv[0])))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
