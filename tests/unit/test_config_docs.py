"""Every option a user can set is documented where the API reference shows it: each field of
`parallax.Config` is an entry of its docstring's ``Attributes`` section (rendered in the API
page by mkdocstrings), and each field of `QSGD` and `SlimDP` is named in its class docstring."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest

import parallax


def _attributes(cls: type) -> list[str]:
    """The names of the Google-style ``Attributes:`` entries of ``cls``'s docstring."""
    doc = inspect.getdoc(cls) or ""
    section = doc.split("Attributes:", 1)[1] if "Attributes:" in doc else ""
    return re.findall(r"^    (\w+):", section, flags=re.MULTILINE)


def test_every_config_field_is_an_attribute_of_its_docstring_in_field_order() -> None:
    fields = [f.name for f in dataclasses.fields(parallax.Config)]
    assert _attributes(parallax.Config) == fields


@pytest.mark.parametrize("cls", [parallax.QSGD, parallax.SlimDP])
def test_every_field_of_the_nested_options_is_named_in_its_docstring(cls: type) -> None:
    doc = inspect.getdoc(cls) or ""
    missing = [f.name for f in dataclasses.fields(cls) if f"``{f.name}``" not in doc]
    assert not missing, missing
