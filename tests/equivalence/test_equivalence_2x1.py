"""The equivalence matrix on 2x1 (2 machines x 1 worker): the tests of test_equivalence.py
(which says what is compared, and how) that read a trained matrix, in a file of their own
so that the suite's two pytest processes (``--dist loadfile``) train the shapes side by side."""

from __future__ import annotations

from test_equivalence import (  # noqa: F401  (collected here too, on this file's shape)
    shapes_fixture,
    test_distributed_equals_single_device,
    test_plan_puts_each_parameter_where_the_design_says,
    test_search_in_training_sampled_chose_and_applied_a_count,
)

distributed = shapes_fixture("2x1")
