"""Writes the results page from the records: ``BENCHMARKS.md`` and its copy in the docs site
(``docs/benchmarks.md``), one row per claim of ``claims.py``.

    python benchmarks/results_page.py           # write both pages
    python benchmarks/results_page.py --check   # exit 1 when a page differs from what it writes

The suite runs the check (``tests/unit/test_results_page.py``): a page edited by hand, or a
claim whose records changed, fails it.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import claims
import records

ROOT = Path(__file__).resolve().parents[1]
PAGES = {ROOT / "BENCHMARKS.md": "benchmarks/figures/", ROOT / "docs" / "benchmarks.md": "figures/"}
SECTIONS = (("targets", "Targets"), ("papers", "The papers"), ("peers", "Peers"),
            ("features", "Features measured"))
FIGURES = (  # figure, what it shows, the bench.sh experiment that draws it
    ("compare-lm-4x1-1gbit.png", "LM 4 x 1 at 1 Gbit/s: every system's step, bytes and memory",
     "lm-4x1"),
    ("time-to-quality-lm-2x2.png", "KJV LM 2 x 2: validation loss against time, 1 Gbit/s and "
     "100 Mbit/s (Figure 7's analog)", "time-to-quality"),
    ("table1.png", "PS against AllReduce on four workloads (Table 1's analog)", "table1"),
    ("table4.png", "AllReduce, PS, OptPS and the hybrid (Table 4's analog)", "table4"),
    ("scaling-fair.png", "LM on 1–8 machines, normalised throughput", "scaling-fair"),
    ("sparsity-fair.png", "the hybrid against ps and AllReduce over α (Table 6's analog)",
     "sparsity-fair"),
    ("slim_dp-k8-100mbit-600steps.png", "Plump-DP, Quant-DP and Slim-DP: accuracy against "
     "time, 8 workers, 100 Mbit/s", "slim-k8-100mbit"),
    ("model_parallel-airfoil-1gbit.png", "batch, model and integrated parallelism on airfoil",
     "mp-airfoil"),
)
HISTORY = "docs/history/"


def _provenance(source: str) -> dict | None:
    """The provenance of the record a claim reads (None: a file inside a record directory,
    whose directory's name says its host)."""
    experiment, stem = source.split("/")[:2]
    path = records.STORE / experiment / f"{stem}.json"
    return (json.loads(path.read_text())["provenance"] or {}) if path.exists() else None


def hosts(claim: claims.Claim) -> list[str]:
    """The host of each record a claim reads, once each."""
    seen: list[str] = []
    for source in claim.sources:
        provenance = _provenance(source)
        host = records.host_slug(provenance.get("host")) if provenance is not None else \
            source.split("/")[1].split("-", 1)[1].split("-20")[0]
        host = "unrecorded" if host == "host-unrecorded" else host
        if host not in seen:
            seen.append(host)
    return seen


def tree(source: str) -> str:
    """`` (tree dirty)`` for a record made from a tree with uncommitted changes (its
    ``diff_sha256`` says which, where it was recorded), `` (tree unrecorded)`` where the
    record does not say; nothing for a clean tree."""
    provenance = _provenance(source)
    if provenance is None:
        return ""
    dirty = provenance.get("dirty")
    return "" if dirty is False else " (tree dirty)" if dirty else " (tree unrecorded)"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table(section: str, fidelity: str | None = None) -> list[str]:
    """The rows of ``section``; with ``fidelity`` ("faithful" or "analog": `claims.FIDELITY`)
    only the paper rows of that kind, with a column saying why."""
    why = [] if fidelity is None else ["against the paper's regime"]
    lines = ["| " + " | ".join(["claim", "paper / target", "ours", "regime", *why, "host",
                                 "verdict", "why", "command", "records"]) + " |",
             "|" + "---|" * (9 + len(why))]
    for claim in claims.CLAIMS:
        if claim.section != section:
            continue
        kind, _, because = claims.FIDELITY.get(claim.id, "").partition(": ")
        if fidelity is not None and kind != fidelity:
            continue
        regime = _cell(claim.regime) + ("" if fidelity is None else f" | {_cell(because)}")
        figure = claim.figure()
        sources = "<br>".join(f"`{s}`{tree(s)}" for s in claim.sources)
        command = f"`bash scripts/bench.sh {claim.bench}`" if claim.bench != "gpu_check.sh" \
            else "`bash scripts/gpu_check.sh`"
        lines.append(
            f"| <a id=\"{claim.id}\"></a>**{claim.id}**: {_cell(claim.claim)} | "
            f"{_cell(claim.reference)} | {figure.detail} | {regime} | "
            f"{', '.join(hosts(claim))} | **{claim.verdict}** | {_cell(claim.reason)} | "
            f"{command} | {sources} |")
    return lines


def host_lines() -> list[str]:
    """Each host the claims' records ran on, as its records describe it."""
    described: dict[str, str] = {}
    for claim in claims.CLAIMS:
        for source in claim.sources:
            path = records.STORE / f"{source.split('/')[0]}/{source.split('/')[1]}.json"
            if not path.exists():
                continue
            source_host = (json.loads(path.read_text())["provenance"] or {}).get("host") or {}
            slug = records.host_slug(source_host)
            if slug != "host-unrecorded" and slug not in described:
                described[slug] = (f"{source_host.get('cpu')}, {source_host.get('cores')} "
                                   f"cores, torch {source_host.get('torch')}")
    described.setdefault("nvidia-h200", "one NVIDIA H200 GPU with 16 CPU cores "
                         "(records under `gpu-check/`)")
    return [f"- `{slug}`: {text}" for slug, text in sorted(described.items())]


def page(figures: str) -> str:
    verdicts = collections.Counter(claim.verdict for claim in claims.CLAIMS)
    counts = ", ".join(f"{verdicts[v]} {v}" for v in claims.VERDICTS if verdicts[v])
    lines = [
        "# Results",
        "",
        "**How to read this page.** Every figure the project quotes is one row below, found by "
        "its id (`BENCHMARKS.md#<id>`: README and the docs link each figure they quote to its "
        "row). A row gives what is claimed, the paper's figure (quoted from "
        "`../shared/papers/`, file and table named) or the target, ours with its paired 95 % "
        "interval and n, the regime, the host, a one-word verdict and why, the command that "
        "makes a new record, and the records it is computed from (`benchmarks/records/<id>"
        ".json`: commit, tree state, command, host and every round are in the record).",
        "",
        "This page is written by `python benchmarks/results_page.py` from the records and "
        "checked by the suite: do not edit it by hand. Ratios are step times paired round by "
        "round (above 1: ours faster), pooled over sittings when a claim reads several "
        "records (`benchmarks/ratios.py`). Every network here is **emulated** (Linux network "
        "namespaces, `tc tbf`, no added delay), and every process of every machine shares "
        "the host's cores, so the host, not the link, bounds most steps. Records are never "
        "overwritten: a re-run adds one (`benchmarks/records.py`). A record marked *(tree "
        "dirty)* ran with uncommitted changes (records filed by `records.py` carry the diff's "
        "hash); *(tree unrecorded)*: an older record that did not say.",
        "",
        f"{len(claims.CLAIMS)} claims: {counts}.",
        "",
        "Hosts:",
        "",
        *host_lines(),
        "",
    ]
    for section, title in SECTIONS:
        if section != "papers":
            lines += [f"## {title}", "", *table(section), ""]
            continue
        faithful = sum(claims.FIDELITY.get(c.id, "").startswith("faithful: ")
                       for c in claims.CLAIMS if c.section == section)
        lines += [f"## {title}", "",
                  f"{faithful} of the paper rows ran as the paper ran them (what they measure "
                  "does not depend on what this host lacks); the others are analogs, their "
                  "regime against the paper's said in the row.", "",
                  "### Faithful", "", *table(section, "faithful"), "",
                  "### Analogs", "", *table(section, "analog"), ""]
    lines += ["## Figures", "",
              "Copies in `benchmarks/figures/`, drawn by the experiment named (a re-run draws "
              "them again into its scratch directory).", ""]
    for name, caption, bench in FIGURES:
        lines += [f"![{caption}]({figures}{name})", "",
                  f"*{caption}* (`bash scripts/bench.sh {bench}`)", ""]
    lines += ["## Older measurements", "",
              f"The dated logs in `{HISTORY}` hold every earlier section of this page and what "
              "each engine change measured at the time (nothing deleted). They quote figures "
              "as they were then; where they and this page differ, this page is current.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="compare the pages with what would be written; write nothing")
    args = parser.parse_args()
    stale = []
    for path, figures in PAGES.items():
        text = page(figures)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path)
        else:
            path.write_text(text)
            print(f"[results] wrote {path.relative_to(ROOT)}")
    if stale:
        sys.exit("stale: " + ", ".join(str(p.relative_to(ROOT)) for p in stale)
                 + ": python benchmarks/results_page.py writes them")


if __name__ == "__main__":
    main()
