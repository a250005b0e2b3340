"""Tests for the KJV decoder, the plain-text LM data pipeline and the example LSTM model."""

from __future__ import annotations

import shutil
import struct
import sys
import zlib
from pathlib import Path

import pytest
import torch

from parallax.data.kjv import FIRST_VERSE, decode_ztext, fetch_kjv, strip_osis
from parallax.data.text import (
    LanguageModelDataset,
    Vocabulary,
    encode_lines,
    load_text_corpus,
    tokenize,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
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
