"""Small files written whole (`parallax.atomic`): replaced, or created only where absent."""

from __future__ import annotations

from pathlib import Path

from parallax.atomic import create_text, replace_text


def test_create_text_makes_a_file_once_and_replace_text_overwrites(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "claim"
    assert create_text(path, "first") is True
    assert create_text(path, "second") is False  # it exists: untouched
    assert path.read_text() == "first"
    replace_text(path, "third")
    assert path.read_text() == "third"
    assert sorted(p.name for p in path.parent.iterdir()) == ["claim"]  # no temporary left
