"""Numbers that cannot drift: every figure README.md and docs/ quote is a link to a claim of
benchmarks/claims.py whose text equals the claim recomputed from its records today; a measured
figure quoted without one fails; the results page equals what its generator writes; and the
records are files that are added, never rewritten."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

claims = pytest.importorskip("claims")
records = pytest.importorskip("records")
results_page = pytest.importorskip("results_page")

CLAIM_LINK = re.compile(r"\[([^\]]+)\]\((?:\.\./)*(?:BENCHMARKS|benchmarks)\.md#([a-z0-9-]+)\)")
# a measured figure: a ratio (1.15x), a time (42 ms, 3.1 s); targets (≥ 1.2x) are not
MEASURED = re.compile(r"(?<![≥≤<>~]\s)(?<![≥≤<>~\w.])(\d+(?:\.\d+)?(?:x(?![\dN])| ms\b| s\b))")
GENERATED = {"BENCHMARKS.md", "docs/benchmarks.md"}


def quoting_pages() -> list[Path]:
    """README.md and the docs pages, but not the results page itself or the dated history."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [p for p in pages if str(p.relative_to(ROOT)) not in GENERATED
            and "history" not in p.relative_to(ROOT).parts]


def prose(text: str) -> str:
    """``text`` without code blocks and code spans (commands and code are not quotes)."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def test_every_claim_computes_from_records_it_names() -> None:
    assert len({c.id for c in claims.CLAIMS}) == len(claims.CLAIMS), "claim ids repeat"
    bench = (ROOT / "scripts" / "bench.sh").read_text()
    for claim in claims.CLAIMS:
        assert claim.verdict in claims.VERDICTS, claim.id
        assert claim.sources, claim.id
        assert claim.bench == "gpu_check.sh" or f"[{claim.bench}]=" in bench, (
            f"{claim.id}: no experiment {claim.bench!r} in scripts/bench.sh")
        figure = claim.figure()
        assert figure.value == figure.value and figure.text, claim.id  # not NaN, printable


def test_a_claims_own_words_quote_no_figure() -> None:
    """A reason or regime says why in words: a measured figure in it would not be recomputed
    (settings such as "8 steps" or "6 MB tables" are not measurements)."""
    quoting = [f"{c.id}: {text!r}" for c in claims.CLAIMS for text in (c.reason, c.claim)
               if MEASURED.search(text) or re.search(r"\d\.\d|\d ?%", text)]
    assert not quoting, "\n".join(quoting)


def test_quoted_figures_are_links_to_claims_that_recompute_to_their_text() -> None:
    quoted = 0
    for page in quoting_pages():
        for text, claim_id in CLAIM_LINK.findall(page.read_text()):
            assert claim_id in claims.BY_ID, f"{page.name}: no claim {claim_id!r}"
            expected = claims.BY_ID[claim_id].figure().text
            assert text == expected, (f"{page.name} quotes {text!r} for {claim_id}; its "
                                      f"records give {expected!r}")
            quoted += 1
    assert quoted >= 5, "README.md quotes its headline results as claim links"


def test_no_measured_figure_is_quoted_without_its_claim() -> None:
    unlinked = []
    for page in quoting_pages():
        text = CLAIM_LINK.sub("", prose(page.read_text()))
        for line in text.splitlines():
            unlinked += [f"{page.relative_to(ROOT)}: {figure!r} in {line.strip()[:90]!r}"
                         for figure in MEASURED.findall(line)]
    assert not unlinked, "figures with no claim link:\n" + "\n".join(unlinked)


def test_the_check_fails_on_a_figure_no_record_holds(tmp_path: Path) -> None:
    """What the check is for: the README's old lead figure (1.24x, one sitting, since
    overwritten) quoted against its claim fails, and an unlinked one is found."""
    claim = claims.BY_ID["lm-4x1-torchrec"]
    assert claim.figure().text != "1.24x"
    assert MEASURED.findall(prose("42 ms, 1.24x TorchRec row-wise (target ≥ 1.2x)")) == [
        "42 ms", "1.24x"]
    missing = claims.Claim(**{**claim.__dict__, "sources": ("compare-lm-4x1-1gbit/nothing",)})
    with pytest.raises(FileNotFoundError, match="compare-lm-4x1-1gbit/nothing"):
        missing.figure()


def test_the_results_page_is_what_the_generator_writes() -> None:
    for path, figures in results_page.PAGES.items():
        assert path.read_text() == results_page.page(figures), (
            f"{path.relative_to(ROOT)} is stale: python benchmarks/results_page.py")


def test_a_record_is_added_never_replaced(tmp_path: Path) -> None:
    source = {"commit": "0123456789abcdef", "host": {"cpu": "AMD EPYC 7B13", "cores": 2}}
    first = records.write("demo", {"rounds": [1]}, source=source, store=tmp_path)
    second = records.write("demo", {"rounds": [2]}, source=source, store=tmp_path)
    assert first.name == "0123456-amd-epyc-2c.json" and second.name == "0123456-amd-epyc-2c-2.json"
    assert records.load(first).payload == {"rounds": [1]}
    assert [r.payload for r in records.records("demo", tmp_path)] == [{"rounds": [1]},
                                                                     {"rounds": [2]}]
    with pytest.raises(FileExistsError):
        first.open("x")


def test_filing_a_scratch_directory_keeps_command_tree_and_companions(tmp_path: Path) -> None:
    scratch = tmp_path / "out"
    (scratch / "profile").mkdir(parents=True)
    (scratch / "compare-x.json").write_text(json.dumps([{"system": "hybrid"}]))
    (scratch / "compare-x.md").write_text("| table |")
    (scratch / "profile" / "rank0.txt").write_text("calls")
    store = tmp_path / "store"
    filed = records.add("lm-2x2", scratch, "compare.py --seed 3 --repeats 3", store=store)
    record = records.load(filed[0])
    assert record.experiment == "compare-x" and record.data["bench"] == "lm-2x2"
    assert record.data["seeds"] == [3]
    assert record.data["provenance"]["tree"] in ("clean", "dirty")
    assert record.data["provenance"]["command"] == "compare.py --seed 3 --repeats 3"
    assert filed[0].with_suffix(".md").read_text() == "| table |"
    assert (filed[1] / "rank0.txt").read_text() == "calls"


def test_filing_refuses_an_output_measured_at_another_commit(tmp_path: Path) -> None:
    scratch = tmp_path / "out"
    scratch.mkdir()
    measured = {"commit": "f" * 40, "dirty": False, "host": {"cpu": "x", "cores": 1}}
    (scratch / "table1.json").write_text(json.dumps({"provenance": measured, "runs": []}))
    with pytest.raises(SystemExit, match="measured at fffffff"):
        records.add("table1", scratch, "table1.py", store=tmp_path / "store")
    assert not (tmp_path / "store").exists()


def test_the_newest_record_is_the_last_finished(tmp_path: Path) -> None:
    for finished, commit in (("2026-12-01 10:00:00 UTC", "b" * 40),
                             ("2026-12-01 09:00:00 UTC", "a" * 40)):
        records.write("scaling", {"at": finished}, store=tmp_path,
                      source={"commit": commit, "host": None, "finished": finished})
    assert records.read(records.newest("scaling", tmp_path)) == {"at": "2026-12-01 10:00:00 UTC"}
    with pytest.raises(FileNotFoundError, match="no record of 'nothing'"):
        records.newest("nothing", tmp_path)


def test_no_committed_record_was_ever_rewritten() -> None:
    """git history: files under benchmarks/records/ are added (or moved), never modified."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    log = subprocess.run(["git", "log", "--format=%h", "--diff-filter=M", "--name-only", "--",
                          "benchmarks/records"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert log.returncode == 0, log.stderr
    assert not log.stdout.strip(), "records rewritten by these commits:\n" + log.stdout


def test_every_paper_row_says_whether_it_ran_as_the_paper_ran_it() -> None:
    """Issue 74's split: each row of the papers' section is faithful or an analog, with why;
    no other row claims either."""
    papers = {claim.id for claim in claims.CLAIMS if claim.section == "papers"}
    assert set(claims.FIDELITY) == papers
    for name, text in claims.FIDELITY.items():
        kind, _, because = text.partition(": ")
        assert kind in {"faithful", "analog"} and because, name
    page = (ROOT / "BENCHMARKS.md").read_text()
    faithful = page.split("### Faithful", 1)[1].split("### Analogs", 1)[0]
    for name, text in claims.FIDELITY.items():
        assert (f'id="{name}"' in faithful) == text.startswith("faithful: "), name
