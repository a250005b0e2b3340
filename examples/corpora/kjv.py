"""The King James Bible as a plain-text corpus, one verse per line.

The text comes from Debian's ``sword-text-kjv`` package (public domain), which ships the
CrossWire SWORD module ``engKJV2006eb`` in the compressed *zText* format:

* ``<testament>.bzs`` -- block index: little-endian records ``(offset u32, size u32,
  uncompressed_size u32)`` locating zlib-compressed blocks inside ``.bzz``;
* ``<testament>.bzv`` -- verse index: little-endian records ``(block u32, offset u32,
  size u16)`` locating each entry inside its *decompressed* block;
* ``<testament>.bzz`` -- the concatenated compressed blocks.

Entries are OSIS XML fragments. Besides the verses, the index holds empty or heading-only
entries (module/testament/book/chapter introductions); they strip to nothing and are skipped.

The download, unpacking and decoding helpers are shared with other SWORD Bibles
(:mod:`corpora.rv1909`): :func:`unpack_module` fetches any zText package,
:func:`versified_verses` decodes a module with its verse references.
"""

from __future__ import annotations

import fcntl
import html
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

from corpora.cache import default_cache_dir, require_online

PACKAGE = "sword-text-kjv"
CORPUS_NAME = "kjv.txt"
FIRST_VERSE = "In the beginning God created the heaven and the earth."
TESTAMENTS = ("ot", "nt")

_BLOCK_RECORD = struct.Struct("<III")
_VERSE_RECORD = struct.Struct("<IIH")

_NOTE = re.compile(r"<note\b[^>]*>.*?</note\s*>", re.DOTALL)
_TITLE = re.compile(r"<title\b([^>]*)>(.*?)</title\s*>", re.DOTALL)
_TAG = re.compile(r"<[^>]*>")
# Stray USFM character markers left by the converter, e.g. ``\nd LORD`` or ``LORD\+nd*``.
_USFM = re.compile(r"\\\+?[a-z]+\d*\*?")
_PILCROW = "\u00b6"  # paragraph mark of the 1769 text: layout, not words
_SPACE = re.compile(r"\s+")
# Heading slots of the verse index open a book or chapter with a start milestone (``sID``);
# the matching end milestones (``eID``) sit inside the last verse, so only ``sID`` counts.
_START_TAG = re.compile(r"<(div|chapter)\b([^>]*\bsID=[^>]*)>")
_ATTR = re.compile(r'(\w+)="([^"]*)"')


# --------------------------------------------------------------------------- decoding


def decode_ztext(bzs: bytes, bzv: bytes, bzz: bytes) -> list[str]:
    """Decode one zText testament into its raw OSIS entries, in index order.

    Markup is kept (see :func:`strip_osis`) and empty entries are returned as ``""`` so the
    result lines up one-to-one with the verse index. Blocks are decompressed on first use.
    """
    blocks = [_BLOCK_RECORD.unpack(r) for r in _records(bzs, _BLOCK_RECORD.size, "bzs")]
    cache: dict[int, bytes] = {}

    def block(number: int) -> bytes:
        if number not in cache:
            if number >= len(blocks):
                raise ValueError(f"verse index points at block {number}, only {len(blocks)}")
            offset, size, _ = blocks[number]
            cache[number] = zlib.decompress(bzz[offset : offset + size])
        return cache[number]

    entries = []
    for record in _records(bzv, _VERSE_RECORD.size, "bzv"):
        number, offset, size = _VERSE_RECORD.unpack(record)
        data = block(number)[offset : offset + size] if size else b""
        entries.append(data.decode("utf-8"))
    return entries


def _records(data: bytes, size: int, what: str) -> Iterator[bytes]:
    """Split an index file into fixed-size records, refusing a truncated one."""
    if len(data) % size:
        raise ValueError(f".{what} index is {len(data)} bytes, not a multiple of {size}")
    return (data[i : i + size] for i in range(0, len(data), size))


def strip_osis(text: str) -> str:
    """Reduce an OSIS fragment to its plain words.

    Notes (footnotes, cross references) are dropped with their contents, as are editorial
    headings (``<title>`` without ``canonical="true"``, e.g. book names or the Psalm 119
    letters); canonical titles such as Psalm superscriptions keep their words. Other tags,
    stray USFM markers (``\\nd``) and pilcrows are removed, entities unescaped and whitespace
    collapsed. Tags become nothing rather than spaces, since markup sometimes splits a word.
    """
    text = _NOTE.sub(" ", text)
    text = _TITLE.sub(_keep_canonical_title, text)
    text = _USFM.sub("", _TAG.sub("", text))
    text = html.unescape(text).replace(_PILCROW, " ")
    return _SPACE.sub(" ", text).strip()


def _keep_canonical_title(match: re.Match[str]) -> str:
    return f" {match.group(2)} " if 'canonical="true"' in match.group(1) else " "


def verses_from_module(module_dir: Path) -> list[str]:
    """Plain verses of a zText module directory (``ot`` then ``nt``), empties skipped."""
    verses = []
    for testament in TESTAMENTS:
        verses += [v for v in map(strip_osis, _testament(module_dir, testament)) if v]
    return verses


def _testament(module_dir: Path, testament: str) -> list[str]:
    parts = [(module_dir / f"{testament}.{ext}").read_bytes() for ext in ("bzs", "bzv", "bzz")]
    return decode_ztext(*parts)


def versified_verses(module_dir: Path) -> list[tuple[str, str]]:
    """``(reference, plain text)`` for every verse slot of a zText module, in canonical order.

    References are OSIS ids such as ``"John.11.35"``. SWORD lays a testament out as: module
    heading, testament heading, then per book a book heading and per chapter a chapter heading
    followed by one slot per verse of the module's versification. The heading slots are
    recognised by their book/chapter start milestones and verses numbered from there, so the
    result does not need a versification table; verses missing from a translation come back
    as ``""`` (their slot exists but is empty), which keeps two modules comparable by reference.
    """
    verses: list[tuple[str, str]] = []
    for testament in TESTAMENTS:
        chapter, number = None, 0
        for entry in _testament(module_dir, testament)[2:]:  # module and testament headings
            kind, osis_id = _heading(entry)
            if kind == "book":
                chapter = None  # a new book: its first chapter heading follows
            elif kind == "chapter":
                chapter, number = osis_id, 0
            elif chapter is None:
                raise ValueError(f"{module_dir.name}: verse slot before any chapter heading "
                                 f"({entry[:80]!r})")
            else:
                number += 1
                verses.append((f"{chapter}.{number}", strip_osis(entry)))
    return verses


def _heading(entry: str) -> tuple[str | None, str]:
    """``("book", "John")`` or ``("chapter", "John.11")`` if the entry opens one, else
    ``(None, "")``."""
    for tag, attrs in _START_TAG.findall(entry):
        fields = dict(_ATTR.findall(attrs))
        if tag == "chapter" and "osisID" in fields:
            return "chapter", fields["osisID"]
        if tag == "div" and fields.get("type") == "book":
            return "book", fields.get("osisID", "")
    return None, ""


def module_conf(module_dir: Path) -> dict[str, str]:
    """The ``mods.d/*.conf`` settings of an unpacked module (e.g. ``Versification``).

    The conf lives beside ``modules/`` in the SWORD tree and names the module's directory in
    its ``DataPath``; repeated keys (``GlobalOptionFilter``) keep their last value.
    """
    sword_root = module_dir.parents[3]  # <root>/modules/texts/ztext/<module>
    for conf in sorted((sword_root / "mods.d").glob("*.conf")):
        fields = {}
        for line in conf.read_text(encoding="utf-8", errors="replace").splitlines():
            key, sep, value = line.partition("=")
            if sep and not line.lstrip().startswith("#"):
                fields[key.strip()] = value.strip()
        if fields.get("DataPath", "").rstrip("/").endswith(f"/{module_dir.name}"):
            return fields
    raise RuntimeError(f"no mods.d/*.conf with DataPath .../{module_dir.name}/ in {sword_root}")


# --------------------------------------------------------------------------- fetching


def fetch_kjv(cache_dir: Path | None = None) -> Path:
    """Return the path of ``kjv.txt`` (one verse per line), building it on first use.

    Building downloads the ``sword-text-kjv`` .deb with ``apt-get download`` (running
    ``apt-get update`` first when the package lists are empty), unpacks it with ``dpkg -x``
    and decodes the module. The result is written atomically so a crash never leaves a
    truncated corpus behind.
    """
    return build_once(cache_dir, CORPUS_NAME, _build, f"{FETCH} kjv")


def build_once(cache_dir: Path | None, name: str, build: Callable[[Path, Path], None],
               fetch_command: str) -> Path:
    """``cache/name``, made by ``build(target, cache)`` if it does not exist yet (``cache``:
    ``cache_dir`` or `default_cache_dir`). Every worker of a local cluster may ask at once:
    one builds under a file lock, the others wait for it. A process marked offline refuses
    to build, naming ``fetch_command`` (`corpora.cache.require_online`)."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache / name
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f".{Path(name).stem}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.exists():
            require_online(name, fetch_command)
            build(target, cache)
    return target


def _build(target: Path, cache: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="kjv-", dir=cache) as tmp:
        verses = verses_from_module(unpack_module(Path(tmp)))
    _check_corpus(verses)
    _write_atomically(target, "".join(v + "\n" for v in verses))
    words = sum(len(v.split()) for v in verses)
    _progress(f"wrote {len(verses):,} verses ({words:,} words) to {target}")


FETCH = "python examples/fetch_corpora.py"
FETCH_COMMANDS = {PACKAGE: f"{FETCH} kjv", "sword-text-sparv": f"{FETCH} kjv-rv1909",
                  "dataset-fashion-mnist": f"{FETCH} fashion-mnist"}


def download_deb(work: Path, package: str = PACKAGE) -> Path:
    """``apt-get download`` a Debian package into ``work``; update empty apt lists once.
    Refuses at once in a process marked offline (`corpora.cache.require_online`)."""
    require_online(f"{package} (Debian package)",
                   FETCH_COMMANDS.get(package, f"apt-get download {package}"))
    if shutil.which("apt-get") is None:
        raise RuntimeError(_manual_hint("apt-get not found (this needs a Debian/Ubuntu host)",
                                        package))
    if not _apt_lists_present():
        _progress("apt package lists are empty; running apt-get update", tag="apt")
        _run(["apt-get", "update"], hint="apt-get update failed (are you root?)",
             package=package)
    _progress(f"downloading {package} with apt-get", tag="apt")
    _run(["apt-get", "download", package], cwd=work, hint=f"apt-get download {package} failed",
         package=package)
    debs = sorted(work.glob(f"{package}_*.deb"))
    if not debs:
        raise RuntimeError(_manual_hint(f"apt-get download left no {package} .deb", package))
    return debs[-1]


def unpack_module(work: Path, package: str = PACKAGE) -> Path:
    """Download a SWORD zText package into ``work``, unpack it there and return the module
    directory (the one holding ``ot.bzs`` ...; its conf is read by :func:`module_conf`)."""
    deb = download_deb(work, package)
    _progress(f"unpacking {deb.name}", tag="apt")
    root = work / package  # one tree per package, so two Bibles never share a mods.d
    _run(["dpkg", "-x", str(deb), str(root)], package=package)
    return _find_module(root, package)


def _apt_lists_present() -> bool:
    lists = Path("/var/lib/apt/lists")
    return lists.is_dir() and any(lists.glob("*_Packages*"))


def _find_module(root: Path, package: str = PACKAGE) -> Path:
    """The directory holding the zText files; the module name varies between releases."""
    for bzs in sorted(root.glob("**/modules/texts/ztext/*/ot.bzs")):
        module = bzs.parent
        if all((module / f"{t}.{e}").exists() for t in TESTAMENTS for e in ("bzs", "bzv", "bzz")):
            return module
    raise RuntimeError(f"no zText module (modules/texts/ztext/*/{{ot,nt}}.bz?) in {package}")


def _check_corpus(verses: list[str]) -> None:
    """Refuse to cache a corpus that decoded wrongly."""
    if not verses or verses[0] != FIRST_VERSE:
        first = verses[0] if verses else None
        raise RuntimeError(f"decoded KJV starts with {first!r}, expected {FIRST_VERSE!r}")
    if not 30_000 <= len(verses) <= 32_000:
        raise RuntimeError(f"decoded KJV has {len(verses)} verses, expected about 31,100")


def _write_atomically(target: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache is shared, plain data
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _run(cmd: list[str], cwd: Path | None = None, hint: str | None = None,
         package: str = PACKAGE) -> None:
    """Run a command quietly; on failure raise with its output and what to do by hand."""
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    except FileNotFoundError as e:
        raise RuntimeError(_manual_hint(f"{cmd[0]} not found", package)) from e
    if proc.returncode:
        output = (proc.stderr or proc.stdout).strip()
        raise RuntimeError(_manual_hint(f"{hint or ' '.join(cmd)}:\n{output}", package))


def _manual_hint(problem: str, package: str = PACKAGE) -> str:
    hint = f"{problem}\nTo fetch it, run as root: apt-get update && apt-get download {package}"
    if package == PACKAGE:
        hint += ("; or put a ready kjv.txt (one verse per line) in the cache directory "
                 "($PARALLAX_CACHE or ~/.cache/parallax)")
    return hint + "."


def _progress(message: str, tag: str = "kjv") -> None:
    print(f"[{tag}] {message}", file=sys.stderr, flush=True)
