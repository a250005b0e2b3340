"""`Config.sharding`: the one mapping that pins a table's sharding kind by name, with the
shorthand fields (`pooled_tables`, `pooled_by_rows`, `pooled_by_columns`) folded into the same
answer (`Config.pinned_sharding`), and what it refuses."""

from __future__ import annotations

import pytest

import parallax
from parallax.config import ShardingName


def test_a_named_table_is_pinned_and_the_others_are_the_planners() -> None:
    config = parallax.Config(sharding={"a.weight": "pooled_by_rows", "b.weight": "rows"})
    assert config.pinned_sharding("a.weight") == (ShardingName.POOLED_BY_ROWS,
                                                  "sharding['a.weight']")
    assert config.pinned_sharding("b.weight") == (ShardingName.ROWS, "sharding['b.weight']")
    assert config.pinned_sharding("c.weight") is None
    assert list(config.named_pins()) == ["a.weight", "b.weight"]


def test_every_other_table_follows_the_star_and_names_come_first() -> None:
    config = parallax.Config(sharding={"*": "rows", "a.weight": "pooled"})
    assert config.pinned_sharding("a.weight")[0] == ShardingName.POOLED
    assert config.pinned_sharding("z.weight") == (ShardingName.ROWS, "sharding['*']")
    assert "*" not in config.named_pins()


def test_the_shorthands_pin_as_they_always_did() -> None:
    config = parallax.Config(pooled_tables=("a",), pooled_by_rows=("b",),
                             pooled_by_columns=("c",))
    assert [config.pinned_sharding(n) for n in "abcd"] == [
        (ShardingName.POOLED, "pooled_tables"), (ShardingName.POOLED_BY_ROWS, "pooled_by_rows"),
        (ShardingName.POOLED_BY_COLUMNS, "pooled_by_columns"),
        (ShardingName.ROWS, "pooled_tables")]  # (a pooled_tables given keeps the rest rows)
    assert parallax.Config().pinned_sharding("d") is None  # the planner's
    agreeing = parallax.Config(pooled_tables=("a",), sharding={"a": "pooled"})
    assert agreeing.pinned_sharding("a")[0] == ShardingName.POOLED


@pytest.mark.parametrize("fields, why", [
    ({"sharding": {"a": "table_wise"}}, "one of"),
    ({"sharding": ["a"]}, "a mapping"),
    ({"sharding": {"": "rows"}}, "a mapping"),
    ({"sharding": {"a": "rows"}, "pooled_tables": ("a",)}, "agrees with Config.pooled_tables"),
    ({"sharding": {"a": "pooled"}, "architecture": "allreduce"}, "architecture='allreduce'"),
    ({"sharding": {"a": "pooled_by_columns"}, "sync": "async-sparse"}, "sync='async-sparse'"),
])
def test_a_mapping_that_cannot_pin_is_refused_naming_the_field(fields: dict, why: str) -> None:
    with pytest.raises(parallax.ConfigError, match=rf"Config.sharding must be .*{why}"):
        parallax.Config(**fields)


def test_rows_under_allreduce_is_no_pooling_and_accepted() -> None:
    assert parallax.Config(architecture="allreduce", sharding={"*": "rows"}).sharding == {
        "*": ShardingName.ROWS}


def test_a_config_with_a_mapping_stays_hashable_and_round_trips_as_plain_values() -> None:
    """Kept read-only (a `Config` is frozen and hashable), given back as plain strings."""
    config = parallax.Config(sharding={"a": "pooled", "*": "rows"})
    assert hash(config) == hash(parallax.Config(sharding={"*": "rows", "a": "pooled"}))
    plain = config.to_dict()["sharding"]
    assert plain == {"a": "pooled", "*": "rows"} and type(plain) is dict
    assert parallax.Config.from_dict(config.to_dict()) == config
    with pytest.raises(TypeError):
        config.sharding["b"] = "rows"  # type: ignore[index]
