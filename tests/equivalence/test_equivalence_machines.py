"""The equivalence matrix across machines, 2x1 and 2x2: the tests of test_equivalence.py (which
says what is compared, and how) that read a trained matrix, here for the two-machine shapes, in
a file of their own so that the suite's two pytest processes (``--dist loadfile``) train them
beside the one-machine shapes."""

from __future__ import annotations

import pytest
from test_equivalence import (  # noqa: F401  (collected here too, on this file's shapes)
    test_distributed_equals_single_device,
    test_plan_puts_each_parameter_where_the_design_says,
    test_search_in_training_sampled_chose_and_applied_a_count,
    trained,
)


@pytest.fixture(scope="module", params=["2x1", "2x2"])
def distributed(request, tmp_path_factory) -> tuple[str, dict]:
    return trained(request.param, tmp_path_factory)
