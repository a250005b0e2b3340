"""What the experiment scripts (table1.py, table4.py, scaling.py, sparsity_sweep.py,
bandwidth_sweep.py) share: common options, one `compare.run` per cluster shape / workload with
progress output and failures recorded instead of lost, and writing <name>.json, .md and .png.

Each experiment writes ``<out-dir>/<name>.json``: ``{"experiment", "command", "options",
"runs": [{"label", "settings", "results" | "error"}], ...}`` where ``results`` are compare.py's
records (see its docstring for what every field means), ``<name>.md`` (summary table, then
each run's full compare table) and ``<name>.png``; each run's raw compare JSON goes to
``<out-dir>/<name>-runs/<label>.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import compare
import records

HERE = Path(__file__).resolve().parent
PARALLAX = ("hybrid", "optps", "ps", "allreduce")
METRICS_NOTE = (
    "Metrics (details: benchmarks/compare.py docstring): throughput = world size x items per "
    "worker batch / median step time; step spread = p10–p90 of the timed steps (each "
    "averaged over ranks); wire bytes = eth0 tx + rx per machine and step (inter-machine, "
    "with protocol overhead); predicted = Table 3 model (`runner.plan.predicted_total(arch)`): "
    "inter-machine payload bytes sent + received per machine and step; wire/predicted = their "
    "ratio; α_model from the plan after the warm-up steps; peak RSS/worker = max over ranks of "
    "each worker's peak resident memory while the system ran, /machine = the sum over a "
    "machine's workers; predicted/worker = RSS before building + the memory model's bytes "
    "(`parallax/planning/memory.py`), max over ranks.")


def add_common_arguments(parser: argparse.ArgumentParser, *, shape: bool = True,
                         lm_shape: bool = True, steps: int = 8, warmup: int = 3) -> None:
    """Options every experiment has: link rate, steps, cluster shape (``shape``: --machines
    as one number), LM sizes (``lm_shape``: --vocab and --seq-len), output."""
    parser.add_argument("--rate", default="1gbit", help="emulated link rate (tc syntax)")
    parser.add_argument("--steps", type=int, default=steps, help="timed steps per system")
    parser.add_argument("--warmup", type=int, default=warmup,
                        help="untimed steps per system (α is measured over them)")
    if shape:
        parser.add_argument("--machines", type=int, default=2)
    parser.add_argument("--nproc-per-machine", type=int, default=2 if shape else 1)
    parser.add_argument("--batch", type=int, help="per worker (default: compare.py's per "
                        "workload)")
    if lm_shape:
        parser.add_argument("--vocab", type=int, default=100_000, help="lm vocabulary")
        parser.add_argument("--seq-len", type=int, default=20, help="lm words per sequence")
    parser.add_argument("--emb", type=int, default=128, help="lm embedding width")
    parser.add_argument("--sampled", type=int, default=512,
                        help="lm sampled softmax classes a step")
    parser.add_argument("--hidden", type=int, default=128, help="lm LSTM width")
    parser.add_argument("--isolate", action="store_true",
                        help="one launch per system (per-system peak memory, no interference)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="interleaved rounds of every system (compare.py --repeats)")
    parser.add_argument("--pin", action="store_true",
                        help="each worker pinned to one core (compare.py --pin)")
    parser.add_argument("--out-dir", type=Path, default=records.scratch())


def compare_args(args: argparse.Namespace, **overrides: Any) -> argparse.Namespace:
    """compare.py's arguments: its defaults, then the experiment's common options, then
    ``overrides`` (names as compare's attributes: machines, systems, workload, ...)."""
    result = compare.parse_args([])
    for name in ("rate", "steps", "warmup", "machines", "nproc_per_machine", "batch", "vocab",
                 "emb", "hidden", "seq_len", "isolate", "repeats", "pin", "sampled"):
        if hasattr(args, name):
            setattr(result, name, getattr(args, name))
    for name, value in overrides.items():
        if not hasattr(result, name):
            raise TypeError(f"compare.py has no option {name!r}")
        setattr(result, name, value)
    result.no_plot = True  # the experiment draws its own figure
    return result


class Experiment:
    """Runs compare once per setting, keeps every run (or its error), writes the outputs."""

    def __init__(self, name: str, args: argparse.Namespace):
        self.name, self.args = name, args
        self.out_dir: Path = args.out_dir
        self.runs: list[dict[str, Any]] = []

    def run(self, label: str, total: int, **overrides: Any) -> dict[str, Any]:
        """``compare.run`` with ``overrides``; prints which run of ``total`` this is. A failed
        run is recorded with its error and the experiment goes on."""
        settings = compare_args(self.args, **overrides)
        settings.out = self.out_dir / f"{self.name}-runs" / f"{label}.json"
        print(f"\n[{self.name}] run {len(self.runs) + 1}/{total}: {label} "
              f"({settings.workload}, {settings.machines}x{settings.nproc_per_machine}, "
              f"{settings.rate}, systems {' '.join(settings.systems)})", flush=True)
        record: dict[str, Any] = {"label": label, "settings": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(settings).items()}}
        try:
            record["results"] = compare.run(settings)
        except Exception as error:  # recorded, reported at the end
            record["error"] = f"{type(error).__name__}: {error}"
            print(f"[{self.name}] {label} FAILED: {record['error']}", file=sys.stderr,
                  flush=True)
        record["markdown"] = (compare.markdown(record["results"], settings)
                              if "results" in record else f"{label}: {record['error']}")
        self.runs.append(record)
        return record

    @property
    def failures(self) -> list[str]:
        return [f"{r['label']}: {r['error']}" for r in self.runs if "error" in r]

    def write(self, summary: str, plot: Callable[[Path], None],
              extra: dict[str, Any] | None = None) -> Path:
        """<name>.json, <name>.md (``summary``, a metrics note, every run's table) and
        <name>.png (``plot(path)``); returns the JSON path."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        base = self.out_dir / self.name
        payload = {"experiment": self.name, "command": [Path(sys.argv[0]).name, *sys.argv[1:]],
                   "options": {k: (str(v) if isinstance(v, Path) else v)
                               for k, v in vars(self.args).items()},
                   **(extra or {}),
                   "runs": [{k: v for k, v in r.items() if k != "markdown"} for r in self.runs]}
        base.with_suffix(".json").write_text(json.dumps(payload, indent=1))
        details = "\n\n".join(f"### {r['label']}\n\n{r['markdown']}" for r in self.runs)
        failed = "".join(f"\n\nFAILED {f}" for f in self.failures)
        base.with_suffix(".md").write_text(
            f"{summary}{failed}\n\n{METRICS_NOTE}\n\n## Runs\n\n{details}\n")
        plot(base.with_suffix(".png"))
        print(f"\n{summary}{failed}\n\n[{self.name}] wrote {base}.json, .md, .png", flush=True)
        return base.with_suffix(".json")

    def exit_status(self) -> int:
        """Non-zero when any run failed (the outputs hold what did run)."""
        if self.failures:
            print(f"[{self.name}] {len(self.failures)} run(s) failed:\n  "
                  + "\n  ".join(self.failures), file=sys.stderr)
            return 1
        return 0


def by_system(results: Iterable[dict]) -> dict[str, dict]:
    """Records that ran, by system name."""
    return {r["system"]: r for r in results if "unavailable" not in r}


def alpha_model(results: Iterable[dict]) -> float | None:
    """α_model as measured by the run's parallax systems (all see the same batches; the first
    one's value), None when no parallax system ran."""
    return next((r["alpha_model"] for r in results
                 if r.get("alpha_model") is not None), None)


#: tc's rate units, bits per second
RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def rate_bits(rate: str) -> float | None:
    """A tc rate (``100mbit``, ``1gbit``) in bits per second each way; None for ``none`` (no
    emulated link)."""
    if rate == "none":
        return None
    for unit in sorted(RATE_UNITS, key=len, reverse=True):
        if rate.endswith(unit):
            return float(rate[:-len(unit)]) * RATE_UNITS[unit]
    raise ValueError(f"not a tc rate: {rate!r} (e.g. 100mbit, 1gbit)")


def link_share(result: dict, rate: str) -> float | None:
    """The share of a system's step its link needs at the nominal rate: half the machine's
    wire bytes a step (what it sends and receives, the link carrying each way at ``rate``)
    over the step. Near 1: the link bounds the step; near 0: the host does."""
    bits = rate_bits(rate)
    if bits is None or not result.get("median_step_s"):
        return None
    return result["wire_bytes_per_machine_step"] / 2 * 8 / bits / result["median_step_s"]


def cell(value: float | None, spec: str = ",.0f") -> str:
    return compare.fmt(value, spec)


def with_ratio(value: float | None, base: float | None) -> str:
    """``6,813 (9.99x)``: a throughput and its ratio to ``base``."""
    ratio = value / base if value and base else None
    return f"{cell(value)} ({cell(ratio, '.2f')}x)"


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, ax: Any, path: Path) -> None:
    """Legend, tight layout, PNG at ``path``, and the figure closed (pyplot keeps it alive)."""
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
