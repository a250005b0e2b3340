"""Tests for the KJV decoder, the plain-text LM data pipeline and the example LSTM model."""

from __future__ import annotations

import shutil
import struct
import sys
import zlib
from pathlib import Path

import pytest
import torch
from corpora.kjv import (
    FIRST_VERSE,
    decode_ztext,
    fetch_kjv,
    module_conf,
    strip_osis,
    versified_verses,
)
from corpora.rv1909 import align_verses, english_spanish_pairs, fetch_verse_pairs
from corpora.text import (
    LanguageModelDataset,
    Vocabulary,
    encode_lines,
    load_text_corpus,
    tokenize,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from lstm_lm import LanguageModel, lm_loss  # noqa: E402

# --------------------------------------------------------------------------- KJV / zText


def make_ztext(blocks: list[list[str]]) -> tuple[bytes, bytes, bytes]:
    """Encode entries grouped into blocks the way SWORD's zText driver stores them."""
    bzs, bzv, bzz = bytearray(), bytearray(), bytearray()
    bzv += struct.pack("<IIH", 0, 0, 0)  # real modules start with an empty entry
    for number, entries in enumerate(blocks):
        raw = bytearray()
        for entry in entries:
            data = entry.encode("utf-8")
            bzv += struct.pack("<IIH", number, len(raw), len(data))
            raw += data
        compressed = zlib.compress(bytes(raw))
        bzs += struct.pack("<III", len(bzz), len(compressed), len(raw))
        bzz += compressed
    return bytes(bzs), bytes(bzv), bytes(bzz)


def test_strip_osis_drops_tags_notes_and_headings() -> None:
    osis = (
        '<div type="x-milestone" subType="x-preverse" sID="pv1"/>'
        '<title level="1" type="main">The First Book of Moses</title> '
        'In the <w lemma="strong:H7225">beginning</w>\n  <w lemma="strong:H0430">God</w> '
        '<transChange type="added">was</transChange> <divineName>\\nd <w>LORD</w></divineName>'
        '.<note placement="foot"><reference type="annotateRef">1.1 </reference>'
        "Heb. <seg>between</seg></note> ¶ <w>afrai</w>d &amp; done "
    )
    assert strip_osis(osis) == "In the beginning God was LORD. afraid & done"


def test_strip_osis_keeps_canonical_titles() -> None:
    osis = '<title canonical="true" type="psalm">A <w>Psalm</w> of David.</title> <l/>LORD, how'
    assert strip_osis(osis) == "A Psalm of David. LORD, how"


def test_strip_osis_heading_only_entry_is_empty() -> None:
    assert strip_osis('<chapter n="1" osisID="Gen.1" sID="Gen.1"/> ') == ""


def test_decode_ztext_reads_entries_across_blocks() -> None:
    blocks = [["<milestone/>"], ["In the <w>beginning</w>.", "", "Ünïcode ’s"], ["last"]]
    entries = decode_ztext(*make_ztext(blocks))
    assert entries == ["", "<milestone/>", "In the <w>beginning</w>.", "", "Ünïcode ’s", "last"]


def test_decode_ztext_rejects_truncated_index() -> None:
    bzs, bzv, bzz = make_ztext([["a"]])
    with pytest.raises(ValueError, match="multiple of 10"):
        decode_ztext(bzs, bzv[:-1], bzz)


@pytest.mark.network
@pytest.mark.skipif(shutil.which("apt-get") is None, reason="needs apt-get (Debian/Ubuntu)")
def test_fetch_kjv_real(tmp_path: Path) -> None:
    path = fetch_kjv(tmp_path)
    assert path == tmp_path / "kjv.txt"
    verses = path.read_text(encoding="utf-8").splitlines()
    assert verses[0] == FIRST_VERSE
    assert verses[-1] == "The grace of our Lord Jesus Christ be with you all. Amen."
    assert 31_000 <= len(verses) <= 31_200
    assert 770_000 <= sum(len(v.split()) for v in verses) <= 810_000
    assert not any("<" in v or "\\" in v or not v.strip() for v in verses)
    # Temp files cleaned up; the lock that serialises concurrent workers stays.
    assert sorted(p.name for p in tmp_path.iterdir()) == [".kjv.lock", "kjv.txt"]
    assert fetch_kjv(tmp_path) == path  # cached: no second download


# --------------------------------------------------------------------------- versified modules


def write_module(root: Path, testaments: dict[str, list[str]], versification: str) -> Path:
    """A SWORD tree under ``root`` with one zText module ``test`` and its mods.d conf."""
    module = root / "modules" / "texts" / "ztext" / "test"
    module.mkdir(parents=True)
    for testament, entries in testaments.items():
        for ext, data in zip(("bzs", "bzv", "bzz"), make_ztext([entries]), strict=True):
            (module / f"{testament}.{ext}").write_bytes(data)
    (root / "mods.d").mkdir()
    (root / "mods.d" / "test.conf").write_text(
        f"[Test]\n# Versification=NRSV is a comment\nDataPath=./modules/texts/ztext/test/\n"
        f"ModDrv=zText\nVersification={versification}\n", encoding="utf-8")
    return module


def test_versified_verses_numbers_slots_after_headings(tmp_path: Path) -> None:
    ot = [
        "<milestone/>",  # testament heading (make_ztext adds the empty module heading)
        '<div canonical="true" osisID="Gen" sID="b1" type="book"/> <title>Genesis</title>',
        '<chapter n="1" osisID="Gen.1" sID="Gen.1"/> ',
        "In the <w>beginning</w>.",
        "",  # a verse this translation lacks: its slot stays, empty
        '<chapter n="2" osisID="Gen.2" sID="Gen.2"/>',
        'Thus. <chapter eID="Gen.2"/> <div canonical="true" eID="b1" osisID="Gen" type="book"/>',
        '<div osisID="Exod" sID="b2" type="book"/>',
        '<chapter osisID="Exod.1" sID="Exod.1"/>',
        "Now these.",
    ]
    nt = ["<milestone/>", '<div osisID="John" sID="b3" type="book"/>',
          '<chapter osisID="John.11" sID="John.11"/>', "Jesus wept."]
    module = write_module(tmp_path, {"ot": ot, "nt": nt}, "KJV")
    assert versified_verses(module) == [
        ("Gen.1.1", "In the beginning."), ("Gen.1.2", ""), ("Gen.2.1", "Thus."),
        ("Exod.1.1", "Now these."), ("John.11.1", "Jesus wept."),
    ]
    assert module_conf(module)["Versification"] == "KJV"


def test_versified_verses_rejects_verse_before_chapter(tmp_path: Path) -> None:
    entries = ["<milestone/>", '<div osisID="Gen" sID="b1" type="book"/>', "stray verse"]
    module = write_module(tmp_path, {"ot": entries, "nt": entries[:1]}, "KJV")
    with pytest.raises(ValueError, match="before any chapter heading"):
        versified_verses(module)


def test_align_verses_by_reference_and_drops_shifted_chapters() -> None:
    english = [("Gen.1.1", "a"), ("Gen.1.2", "b"), ("Gen.1.3", "c"), ("Gen.2.1", "d"),
               ("Gen.2.2", "e"), ("Gen.3.1", "f"), ("Gen.4.1", "g"), ("Exod.1.1", "h"),
               ("Exod.1.2", "")]
    spanish = [("Exod.1.2", ""), ("Exod.1.1", "H"), ("Gen.4.1", "G"), ("Gen.3.1", "F"),
               ("Gen.2.2", ""), ("Gen.2.1", "D"), ("Gen.1.3", "C"), ("Gen.1.1", "A")]
    # Gen.1.2 has no Spanish slot; Gen.2.2 is empty on one side only, so Gen.2 and the next
    # chapter, Gen.3, may be shifted; Exod.1.2 is empty on both sides, which shifts nothing.
    assert align_verses(english, spanish) == [
        ("Gen.1.1", "a", "A"), ("Gen.1.3", "c", "C"), ("Gen.4.1", "g", "G"),
        ("Exod.1.1", "h", "H"),
    ]


def test_missing_apt_get_names_the_package(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="(?s)not found.*sword-text-kjv sword-text-sparv"):
        fetch_verse_pairs(tmp_path)


@pytest.mark.network
@pytest.mark.skipif(shutil.which("apt-get") is None, reason="needs apt-get (Debian/Ubuntu)")
def test_fetch_verse_pairs_real(tmp_path: Path) -> None:
    path = fetch_verse_pairs(tmp_path)
    assert path == tmp_path / "kjv-rv1909.tsv"
    rows = [line.split("\t") for line in path.read_text(encoding="utf-8").splitlines()]
    pairs = {ref: (english, spanish) for ref, english, spanish in rows}
    assert rows[0] == ["Gen.1.1", "In the beginning God created the heaven and the earth.",
                       "EN el principio crió Dios los cielos y la tierra."]
    assert rows[-1][0] == "Rev.22.21"
    assert 30_000 <= len(pairs) <= 31_102  # KJV versification has 31,102 verses
    assert pairs["John.11.35"] == ("Jesus wept.", "Y lloró Jesús.")
    assert pairs["Gen.1.3"] == ("And God said, Let there be light: and there was light.",
                                "Y dijo Dios: Sea la luz: y fué la luz.")
    assert pairs["Ps.23.1"][1] == "Salmo de David. JEHOVÁ es mi pastor; nada me faltará."
    # RV1909 starts Jonah 2 with KJV's 1:17: both chapters are left out, Jonah 3 is aligned.
    assert "Jonah.1.17" not in pairs and "Jonah.2.1" not in pairs
    assert pairs["Jonah.3.1"][1].startswith("Y FUÉ palabra de Jehová segunda vez á Jonás")
    assert all(english and spanish and "<" not in english + spanish for english, spanish
               in pairs.values())
    assert sorted(p.name for p in tmp_path.iterdir()) == [".kjv-rv1909.lock", "kjv-rv1909.tsv"]
    assert fetch_verse_pairs(tmp_path) == path  # cached: no second download
    assert english_spanish_pairs(tmp_path)[0] == tuple(rows[0][1:])


# --------------------------------------------------------------------------- text pipeline


def test_tokenize_splits_punctuation_and_lowercases() -> None:
    assert tokenize("And God said, Let there be LIGHT: and the LORD’s word!") == [
        "and", "god", "said", ",", "let", "there", "be", "light", ":",
        "and", "the", "lord’s", "word", "!",
    ]  # fmt: skip
    assert tokenize("   ") == []


def test_vocabulary_keeps_most_frequent_with_specials_first() -> None:
    lines = [["b", "a", "b"], ["c", "b", "a"], ["d"]]
    vocab = Vocabulary.build(lines, max_size=4)
    assert vocab.itos == ["<unk>", "<eos>", "b", "a"]
    assert len(vocab) == 4
    assert vocab.encode(["a", "b", "zzz", "c"]) == [3, 2, 0, 0]
    assert vocab.decode([2, 3, 1]) == ["b", "a", "<eos>"]
    assert len(Vocabulary.build(lines, max_size=None)) == 6
    with pytest.raises(ValueError):
        Vocabulary.build(lines, max_size=1)


def test_language_model_dataset_windows() -> None:
    ids = torch.arange(23)
    ds = LanguageModelDataset(ids, seq_len=4)
    assert len(ds) == 4  # 23 // 5, ragged tail dropped
    x, y = ds[1]
    assert x.tolist() == [5, 6, 7, 8] and y.tolist() == [6, 7, 8, 9]
    assert x.dtype == y.dtype == torch.long
    batch_x, batch_y = next(iter(torch.utils.data.DataLoader(ds, batch_size=3)))
    assert batch_x.shape == batch_y.shape == (3, 4)
    with pytest.raises(ValueError):
        LanguageModelDataset(ids.float(), seq_len=4)


def test_encode_lines_appends_eos() -> None:
    vocab = Vocabulary.build([["a", "b"]], max_size=None)
    assert encode_lines([["a"], ["b", "x"]], vocab).tolist() == [2, 1, 3, 0, 1]


def test_load_text_corpus_holds_out_last_lines(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    lines = [f"Line number {i} says hello." for i in range(19)] + ["", "Goodbye tail words."]
    corpus.write_text("\n".join(lines) + "\n", encoding="utf-8")
    train, valid, vocab = load_text_corpus(corpus, max_vocab=50, seq_len=3, valid_fraction=0.1)
    # 20 non-blank lines: the last 2 are validation, and their new words are not in the vocab
    assert len(vocab) == 2 + 5 + 18  # specials, "line number says hello .", "0".."17"
    assert len(train) == (18 * 7) // 4 and len(valid) == (7 + 5) // 4
    assert " ".join(vocab.decode(valid.windows.flatten().tolist())) == (
        "line number <unk> says hello . <eos> <unk> <unk> <unk> . <eos>"
    )


# --------------------------------------------------------------------------- model


@pytest.mark.parametrize("tie_weights,hidden", [(False, 24), (True, 16), (True, 24)])
def test_language_model_forward_and_trace(tie_weights: bool, hidden: int) -> None:
    torch.manual_seed(0)
    model = LanguageModel(30, emb_dim=16, hidden=hidden, layers=2, tie_weights=tie_weights)
    tokens = torch.randint(0, 30, (3, 7))
    logits = model(tokens)
    assert logits.shape == (3, 7, 30)
    loss = lm_loss(logits, tokens)
    assert loss.ndim == 0 and torch.isfinite(loss)
    traced = torch.fx.symbolic_trace(model)
    torch.testing.assert_close(traced(tokens), logits)


def test_tied_weights_share_one_parameter() -> None:
    model = LanguageModel(30, emb_dim=16, hidden=24, tie_weights=True)
    assert model.decoder.weight is model.embedding.weight
    names = [name for name, _ in model.named_parameters()]
    assert "decoder.weight" not in names  # deduplicated: optimizers see it once
    lm_loss(model(torch.randint(0, 30, (2, 5))), torch.randint(0, 30, (2, 5))).backward()
    assert model.embedding.weight.grad is not None
    untied = LanguageModel(30, emb_dim=16, hidden=16)
    assert untied.decoder.weight is not untied.embedding.weight


def test_lm_loss_is_mean_token_cross_entropy() -> None:
    logits = torch.zeros(2, 3, 5)
    targets = torch.zeros(2, 3, dtype=torch.long)
    torch.testing.assert_close(lm_loss(logits, targets), torch.log(torch.tensor(5.0)))
