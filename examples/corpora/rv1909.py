"""Verse-aligned English–Spanish Bible pairs: King James Version × Reina-Valera 1909.

The Spanish text comes from Debian's ``sword-text-sparv`` package (public domain), which ships
the CrossWire SWORD module ``spaRV1909eb`` in the same zText format as ``sword-text-kjv``; both
are downloaded with ``apt-get download`` and decoded by the helpers of :mod:`corpora.kjv`.

Both modules declare ``Versification=KJV`` in their ``mods.d`` conf, so a verse reference names
the same slot in both and verses are paired by reference (``"John.11.35"``). The Spanish source
still numbers a few chapters its own way (e.g. Numbers 12:16 is its 13:1, Jonah 1:17 its 2:1);
the converter then leaves the last KJV slots of such a chapter empty and shifts the next one.
:func:`align_verses` therefore drops a chapter where one side has an empty slot that the other
fills, together with the next chapter of the same book, and skips pairs with an empty side.
A few shifts inside chapters that leave no empty slot (e.g. 1 Chronicles 21:16-30) remain.

The pairs are cached as ``kjv-rv1909.tsv`` (``reference<TAB>english<TAB>spanish``, one verse a
line) in :func:`~corpora.kjv.default_cache_dir`.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from corpora import kjv

PACKAGE = "sword-text-sparv"
CORPUS_NAME = "kjv-rv1909.tsv"
FIRST_SPANISH_VERSE = "EN el principio crió Dios los cielos y la tierra."
VERSES_KJV = 31_102  # verse slots of the KJV versification (no Apocrypha)


def fetch_verse_pairs(cache_dir: Path | None = None) -> Path:
    """Return the path of ``kjv-rv1909.tsv``, building it on first use.

    Building downloads ``sword-text-kjv`` and ``sword-text-sparv`` with ``apt-get download``,
    unpacks and decodes both, checks that they share a versification and aligns them with
    :func:`align_verses`. Concurrent callers wait for one builder; the file is written
    atomically.
    """
    return kjv.build_once(cache_dir, CORPUS_NAME, _build, f"{kjv.FETCH} kjv-rv1909")


def load_verse_pairs(cache_dir: Path | None = None) -> dict[str, tuple[str, str]]:
    """``{reference: (english, spanish)}`` in canonical order (Genesis 1:1 first)."""
    pairs = {}
    for line in fetch_verse_pairs(cache_dir).read_text(encoding="utf-8").splitlines():
        ref, english, spanish = line.split("\t")
        pairs[ref] = (english, spanish)
    return pairs


def english_spanish_pairs(cache_dir: Path | None = None) -> list[tuple[str, str]]:
    """The ``(english, spanish)`` verse pairs in canonical order, about 30,500 of them."""
    return list(load_verse_pairs(cache_dir).values())


def align_verses(english: list[tuple[str, str]], spanish: list[tuple[str, str]],
                 ) -> list[tuple[str, str, str]]:
    """Pair two versified texts (``(reference, text)`` lists) by reference.

    Returns ``(reference, english, spanish)`` in the order of ``english``. Pairs with an empty
    side are skipped, and so is every verse of a chapter where exactly one side is empty in
    some slot, and of the chapter after it in the same book: there the translations put a
    chapter boundary elsewhere, so neighbouring slots hold different verses.
    """
    other = dict(spanish)
    suspect = set()
    for ref, text in english:
        if ref in other and bool(text) != bool(other[ref]):
            book, chapter, _ = ref.split(".")
            suspect |= {f"{book}.{chapter}", f"{book}.{int(chapter) + 1}"}
    return [(ref, text, other[ref]) for ref, text in english
            if text and other.get(ref) and ref.rsplit(".", 1)[0] not in suspect]


def _build(target: Path, cache: Path) -> None:
    if shutil.which("apt-get") is None:  # say so before downloading half of the pair
        raise RuntimeError(
            f"apt-get not found (this needs a Debian/Ubuntu host)\nTo fetch the English-Spanish "
            f"pairs, run as root: apt-get update && apt-get download {kjv.PACKAGE} {PACKAGE}; "
            f"or put a ready {CORPUS_NAME} (reference<TAB>english<TAB>spanish per line) in the "
            "cache directory ($PARALLAX_CACHE or ~/.cache/parallax).")
    kjv._progress(
        "building English-Spanish verse pairs from the Debian packages sword-text-kjv "
        "(King James Version, 1769) and sword-text-sparv (Reina-Valera 1909), both public "
        "domain CrossWire SWORD modules", tag="rv1909")
    with tempfile.TemporaryDirectory(prefix="rv1909-", dir=cache) as tmp:
        modules = [kjv.unpack_module(Path(tmp), package) for package in (kjv.PACKAGE, PACKAGE)]
        schemes = [kjv.module_conf(m).get("Versification", "KJV") for m in modules]
        if schemes[0] != schemes[1]:
            raise RuntimeError(
                f"{kjv.PACKAGE} uses {schemes[0]} versification and {PACKAGE} {schemes[1]}; "
                "aligning them needs a versification mapping, which is not implemented")
        english, spanish = (kjv.versified_verses(m) for m in modules)
    if [ref for ref, _ in english] != [ref for ref, _ in spanish]:
        raise RuntimeError(f"{kjv.PACKAGE} and {PACKAGE} decode to different verse references")
    pairs = align_verses(english, spanish)
    _check_pairs(pairs)
    kjv._write_atomically(target, "".join(f"{r}\t{e}\t{s}\n" for r, e, s in pairs))
    kjv._progress(f"wrote {len(pairs):,} verse pairs ({len(english):,} verse slots) to {target}",
                  tag="rv1909")


def _check_pairs(pairs: list[tuple[str, str, str]]) -> None:
    """Refuse to cache pairs that decoded or aligned wrongly."""
    first = pairs[0] if pairs else None
    if first != ("Gen.1.1", kjv.FIRST_VERSE, FIRST_SPANISH_VERSE):
        raise RuntimeError(f"first verse pair is {first!r}, expected Genesis 1:1")
    if not 29_000 <= len(pairs) <= VERSES_KJV:
        raise RuntimeError(f"{len(pairs)} verse pairs, expected about 30,500")
