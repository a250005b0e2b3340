"""The shared value checks: a bool is not an int anywhere in parallax."""

from __future__ import annotations

import pytest

import parallax
from parallax.checkpoint.files import step_dir
from parallax.checks import is_int, is_number


def test_bools_are_not_ints_or_numbers() -> None:
    assert is_int(3) and is_int(0, at_least=0) and not is_int(0, at_least=1)
    assert not is_int(True) and not is_int(1.0) and not is_int("1")
    assert is_number(0.5) and is_number(2) and not is_number(False)


@pytest.mark.parametrize("call", [lambda: step_dir("root", True),
                                  lambda: parallax.partitioner(max_partitions=True).__enter__()])
def test_callers_refuse_a_bool_count(call) -> None:
    with pytest.raises(ValueError, match="True"):
        call()
