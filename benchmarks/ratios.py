"""How far ahead one system is of another, round by round, pooled over sittings.

A ratio of two medians taken from one sitting of this host moves by 20 % from one sitting to
the next (BENCHMARKS.md, issue 37). ``compare.py --repeats N`` runs every system once per
round, interleaved, so each round gives a *paired* ratio (the other system's step over ours,
both in the same few minutes of the host). This script reads compare records and reports, per
record (a sitting) and pooled over all of them:

* every round's ratio ``other / ours`` (above 1: ours is faster);
* their geometric mean, and a 95 % interval for it from Student's t on the log ratios
  (``scipy.stats``): over rounds within a sitting, and, pooled, over the sittings' own
  geometric means (rounds of one sitting share its host state, so they are not independent
  draws of the host; the sitting-level interval is the honest one when there are several).

    python benchmarks/ratios.py --ours hybrid --other torchrec-tw torchrec-plan \\
        benchmarks/records/compare-recsys-2x2-1gbit-session37/441e71e-intel-xeon-2c.json \\
        benchmarks/records/compare-recsys-2x2-1gbit-session41/c124bc4-intel-xeon-2c.json
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

import records as record_store
from scipy import stats


@dataclass(frozen=True)
class Sitting:
    """One record's paired rounds: ``ratios[r]`` is the other system's step over ours."""

    name: str
    commit: str
    ratios: tuple[float, ...]

    @property
    def geomean(self) -> float:
        return geomean(self.ratios)


def geomean(values: tuple[float, ...] | list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def interval(values: tuple[float, ...] | list[float], level: float = 0.95
             ) -> tuple[float, float] | None:
    """Student's t interval for the geometric mean of ``values`` (None for fewer than 2)."""
    if len(values) < 2:
        return None
    logs = [math.log(v) for v in values]
    mean = sum(logs) / len(logs)
    sem = stats.sem(logs)
    if sem == 0:
        return (math.exp(mean), math.exp(mean))
    low, high = stats.t.interval(level, len(logs) - 1, loc=mean, scale=sem)
    return (math.exp(low), math.exp(high))


def paired_rounds(records: list[dict], ours: str, other: str, source: str) -> Sitting:
    """The per-round ratios of ``other`` over ``ours`` in one compare record (a list of
    per-system records, each with its rounds under ``repeats`` in round order)."""
    by_system = {record["system"]: record for record in records}
    for system in (ours, other):
        if system not in by_system:
            raise SystemExit(f"{source}: no system {system!r} (it has {sorted(by_system)})")
    ours_rounds = _round_steps(by_system[ours])
    other_rounds = _round_steps(by_system[other])
    if len(ours_rounds) != len(other_rounds):
        raise SystemExit(f"{source}: {ours} ran {len(ours_rounds)} rounds, {other} "
                         f"{len(other_rounds)}: not paired")
    provenance = by_system[ours].get("provenance") or {}
    return Sitting(source, str(provenance.get("commit", "?"))[:7],
                   tuple(o / u for u, o in zip(ours_rounds, other_rounds, strict=True)))


def _round_steps(record: dict) -> list[float]:
    repeats = record.get("repeats") or [record]
    return [float(r["median_step_s"]) for r in repeats]


def pooled(sittings: list[Sitting]) -> dict:
    """The sittings' geometric means pooled (t over sittings), and every round pooled."""
    means = [s.geomean for s in sittings]
    rounds = [r for s in sittings for r in s.ratios]
    return {"sittings": len(sittings), "rounds": len(rounds),
            "geomean_of_sittings": geomean(means), "interval_over_sittings": interval(means),
            "geomean_of_rounds": geomean(rounds), "interval_over_rounds": interval(rounds),
            "rounds_ours_faster": sum(r > 1 for r in rounds)}


def markdown(sittings: list[Sitting], summary: dict, ours: str, other: str) -> str:
    def span(bounds: tuple[float, float] | None) -> str:
        return "n/a" if bounds is None else f"{bounds[0]:.2f}–{bounds[1]:.2f}"

    lines = [f"| sitting | commit | {other} / {ours}, round by round | geometric mean | "
             "95 % interval (rounds) |", "|---|---|---|---|---|"]
    for s in sittings:
        lines.append(f"| `{Path(s.name).name}` | `{s.commit}` | "
                     f"{', '.join(f'{r:.2f}' for r in s.ratios)} | {s.geomean:.2f}x | "
                     f"{span(interval(s.ratios))} |")
    lines.append(f"| **pooled** | | {summary['rounds_ours_faster']} of {summary['rounds']} "
                 f"rounds ours faster | **{summary['geomean_of_sittings']:.2f}x** (sittings), "
                 f"{summary['geomean_of_rounds']:.2f}x (rounds) | "
                 f"{span(summary['interval_over_sittings'])} over sittings, "
                 f"{span(summary['interval_over_rounds'])} over rounds |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("records", nargs="+", type=Path, help="compare.py records (JSON)")
    parser.add_argument("--ours", default="hybrid", help="the system whose lead is measured")
    parser.add_argument("--other", required=True, nargs="+",
                        help="the system(s) it is measured against, each in every record")
    parser.add_argument("--out", type=Path, help="also write the sittings and summaries as JSON")
    args = parser.parse_args()
    records = {path: record_store.read(path) for path in args.records}
    comparisons = []
    for other in args.other:
        sittings = [paired_rounds(data, args.ours, other, str(path))
                    for path, data in records.items()]
        summary = pooled(sittings)
        print(markdown(sittings, summary, args.ours, other), end="\n\n")
        comparisons.append({
            "ours": args.ours, "other": other, "summary": summary,
            "sittings": [{"record": s.name, "commit": s.commit, "ratios": s.ratios,
                          "geomean": s.geomean} for s in sittings]})
    if args.out:
        args.out.write_text(json.dumps(comparisons, indent=1) + "\n")


if __name__ == "__main__":
    main()
