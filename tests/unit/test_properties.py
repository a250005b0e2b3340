"""Property tests: resource files and `Config` accept exactly what they document, and every
rejection names the offending line, field or value."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable
from datetime import timedelta
from pathlib import PurePosixPath
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from parallax.cluster import (
    Machine,
    ResourceError,
    ResourceSpec,
    local_spec,
    parse_resource_text,
    parse_resources,
)
from parallax.config import (
    ARCHITECTURES,
    DENSE_SYNCS,
    NONFINITE,
    QSGD,
    Config,
    ConfigError,
    SlimDP,
)
from parallax.planning.architectures import architecture_of

# Derandomised and without an example database: the same examples on every run and machine,
# and nothing written into the repository.
PROPERTY = settings(max_examples=150, deadline=None, database=None, derandomize=True)

# ---------------------------------------------------------------------------------------------
# Resource files
# ---------------------------------------------------------------------------------------------

#: Kept out of generated comments: newlines end a comment; the other separators that
#: str.splitlines() would split at must not (test_comment_with_form_feed_stays_a_comment).
LINE_BREAKS = "\n\r"
SPACE = st.sampled_from(["", " ", "  ", "\t"])
HOSTNAME = st.from_regex(r"[A-Za-z0-9_]([A-Za-z0-9_.-]{0,20}[A-Za-z0-9_])?", fullmatch=True)
COMMENT = st.text(st.characters(exclude_categories=("Cs",), exclude_characters=LINE_BREAKS),
                  max_size=15)
ASCII_COMMENT = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=15)
DEVICES = st.lists(st.integers(0, 10_000), min_size=1, max_size=6, unique=True)


def is_hostname(text: str) -> bool:
    """A host name as the module docstring allows it (independent of the parser's regex)."""
    allowed = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")
    return (bool(text) and set(text) <= allowed and text[0] not in ".-"
            and text[-1] not in ".-")


@st.composite
def device_list(draw: st.DrawFn, devices: list[int]) -> str:
    """Render devices with the whitespace and leading zeros the parser tolerates."""
    items = [draw(SPACE) + draw(st.sampled_from(["", "0", "00"])) + str(d) + draw(SPACE)
             for d in devices]
    return ",".join(items)


@st.composite
def host_and_text(draw: st.DrawFn) -> tuple[str, str, bool]:
    """(host as parsed, host as written, whether it is a bracketed IPv6 address)."""
    kind = draw(st.sampled_from(["name", "ipv4", "ipv6"]))
    if kind == "name":
        host = draw(HOSTNAME)
        return host, host, False
    if kind == "ipv4":
        host = str(draw(st.ip_addresses(v=4)))
        return host, host, False
    host = str(draw(st.ip_addresses(v=6)))
    return host, f"[{host}]", True


@st.composite
def machine_line(draw: st.DrawFn, comments: st.SearchStrategy[str] = COMMENT
                 ) -> tuple[str, Machine]:
    """One valid machine line and the machine it describes."""
    host, written, bracketed = draw(host_and_text())
    devices = draw(st.none() | DEVICES)
    body = written
    if devices is not None:
        # ``host :0`` is accepted, ``[v6] :0`` is not (see the report): no space there.
        before_colon = "" if bracketed else draw(SPACE)
        body += before_colon + ":" + draw(device_list(devices))
    comment = draw(st.none() | comments)
    line = draw(SPACE) + body + draw(SPACE) + ("" if comment is None else "#" + comment)
    return line, Machine(host, tuple(devices or ()))


def filler_line(comments: st.SearchStrategy[str] = COMMENT) -> st.SearchStrategy[str]:
    """Lines that describe no machine: blank, blank-ish, or only a comment."""
    return SPACE | st.builds(lambda s, c: s + "#" + c, SPACE, comments)


@st.composite
def resource_file(draw: st.DrawFn, comments: st.SearchStrategy[str] = COMMENT,
                  min_machines: int = 1) -> tuple[list[str], list[Machine]]:
    """Lines of a resource file and its machines in order."""
    entries = draw(st.lists(
        st.one_of(machine_line(comments), filler_line(comments).map(lambda f: (f, None))),
        max_size=12,
    ))
    machines = [m for _, m in entries if m is not None]
    extra = draw(st.lists(machine_line(comments), min_size=max(0, min_machines - len(machines)),
                          max_size=max(0, min_machines - len(machines))))
    entries += extra
    return [line for line, _ in entries], [m for _, m in entries if m is not None]


def check_spec(spec: ResourceSpec, machines: list[Machine]) -> None:
    assert spec.machines == tuple(machines)
    assert spec.world_size == sum(max(1, len(m.devices)) for m in machines)
    expected_layout = [i for i, m in enumerate(machines) for _ in range(max(1, len(m.devices)))]
    assert list(spec.machine_of_rank) == expected_layout
    for rank, machine in enumerate(expected_layout):
        local = rank - expected_layout.index(machine)
        devices = machines[machine].devices
        assert spec.device_of_rank(rank) == (devices[local] if devices else None)
    assert ResourceSpec.from_json(spec.to_json()) == spec


@PROPERTY
@given(resource_file())
def test_valid_resource_text_parses_to_its_machines(drawn):
    lines, machines = drawn
    check_spec(parse_resource_text("\n".join(lines)), machines)


@PROPERTY
@given(resource_file(comments=ASCII_COMMENT), st.sampled_from(["\n", "\r\n"]), st.booleans())
def test_valid_resource_file_parses_to_its_machines(tmp_path_factory, drawn, newline, final):
    lines, machines = drawn
    path = tmp_path_factory.mktemp("resources") / "resources.txt"
    path.write_bytes((newline.join(lines) + (newline if final else "")).encode("ascii"))
    check_spec(parse_resources(path), machines)


@PROPERTY
@given(st.lists(filler_line(), max_size=6))
def test_file_without_machines_is_rejected(lines):
    with pytest.raises(ResourceError, match=r"^res\.txt:1: empty resource file"):
        parse_resource_text("\n".join(lines), source="res.txt")


# Each strategy draws (bad line, what the error must say about it).


@st.composite
def duplicate_device(draw: st.DrawFn) -> tuple[str, str]:
    _, written, _ = draw(host_and_text())
    devices = draw(DEVICES)
    first = draw(st.integers(0, len(devices) - 1))
    at = draw(st.integers(first + 1, len(devices)))
    devices.insert(at, devices[first])
    return f"{written}:{draw(device_list(devices))}", f"duplicate device {devices[first]}"


NOT_DECIMAL = st.text(
    st.characters(exclude_categories=("Cs",), exclude_characters=LINE_BREAKS + ",#"),
    min_size=1, max_size=6,
).filter(lambda t: bool(t.strip()) and not (t.strip().isdecimal() and t.strip().isascii()))


@st.composite
def non_numeric_device(draw: st.DrawFn) -> tuple[str, str]:
    _, written, _ = draw(host_and_text())
    devices = [str(d) for d in draw(st.lists(st.integers(0, 99), unique=True, max_size=3))]
    token = draw(NOT_DECIMAL | st.sampled_from(["-1", "+2", "1.0", "0x3", "\u0663", "1 2"]))
    devices.insert(draw(st.integers(0, len(devices))), token)
    return f"{written}:{','.join(devices)}", (
        f"device {token.strip()!r} is not a non-negative integer"
    )


@st.composite
def empty_device(draw: st.DrawFn) -> tuple[str, str]:
    _, written, _ = draw(host_and_text())
    devices = [str(d) for d in draw(st.lists(st.integers(0, 99), unique=True, max_size=3))]
    devices.insert(draw(st.integers(0, len(devices))), draw(SPACE))
    return f"{written}:{','.join(devices)}", "empty device"


@st.composite
def missing_host(draw: st.DrawFn) -> tuple[str, str]:
    devices = draw(st.none() | DEVICES)
    rest = "" if devices is None else draw(device_list(devices))
    return f"{draw(SPACE)}:{rest}", "missing host"


BAD_HOST = st.text(
    st.characters(exclude_categories=("Cs",), exclude_characters=LINE_BREAKS + ":#"),
    min_size=1, max_size=12,
).filter(lambda t: bool(t.strip()) and not t.strip().startswith("[")
         and not is_hostname(t.strip()))


@st.composite
def bad_host(draw: st.DrawFn) -> tuple[str, str]:
    host = draw(BAD_HOST | st.sampled_from(["-node", "node-", "no de", "n\u00f6de", ".a", "a$b"]))
    devices = draw(st.none() | DEVICES)
    line = host if devices is None else f"{host}:{draw(device_list(devices))}"
    return line, f"bad host {host.strip()!r}"


@st.composite
def bad_bracket(draw: st.DrawFn) -> tuple[str, str]:
    address = str(draw(st.ip_addresses(v=6)))
    line = draw(st.sampled_from([
        f"[{address}",                  # unclosed
        f"[{address}]x",                # junk after the bracket
        f"[{address}] :0",              # space before the device list
        "[node-a]:0",                   # not an IPv6 address
        "[]",
    ]))
    return line, "bad host"


BAD_LINE = st.one_of(duplicate_device(), non_numeric_device(), empty_device(), missing_host(),
                     bad_host(), bad_bracket())


@PROPERTY
@given(resource_file(min_machines=0), BAD_LINE, st.data())
def test_invalid_line_is_rejected_naming_line_number_and_text(drawn, bad, data):
    lines, _ = drawn
    bad_line, reason = bad
    comment = data.draw(st.none() | COMMENT, label="comment")
    if comment is not None:
        bad_line += "  #" + comment
    at = data.draw(st.integers(0, len(lines)), label="at")
    lines.insert(at, bad_line)
    with pytest.raises(ResourceError) as err:
        parse_resource_text("\n".join(lines), source="cluster.txt")
    message = str(err.value)
    assert message.startswith(f"cluster.txt:{at + 1}: "), message
    assert reason in message
    assert message.endswith(bad_line.strip())


@PROPERTY
@given(st.integers(1, 16), st.integers(1, 16))
def test_local_spec_emulates_equal_local_machines(machines, nproc):
    spec = local_spec(machines, nproc)
    assert spec.world_size == machines * nproc
    assert all(m.devices == tuple(range(nproc)) for m in spec.machines)
    assert [spec.first_rank(i) for i in range(machines)] == [i * nproc for i in range(machines)]
    assert spec.is_local()


@PROPERTY
@given(st.integers(-5, 5), st.integers(-5, 5))
def test_local_spec_rejects_non_positive_shapes(machines, nproc):
    if machines >= 1 and nproc >= 1:
        return
    with pytest.raises(ValueError, match="at least 1"):
        local_spec(machines, nproc)


def test_comment_with_form_feed_stays_a_comment():
    spec = parse_resource_text("localhost:0  # retired:\x0cnode-b:1\n")
    assert spec.machines == (Machine("localhost", (0,)),)


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------

ANY_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.integers(-3, 3),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(0, 1),
    st.sampled_from(ARCHITECTURES),
    st.sampled_from(DENSE_SYNCS),
    st.text(max_size=8),
    st.text(max_size=8).map(PurePosixPath),
    st.lists(st.integers(), max_size=2),
)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite_positive(value: object) -> bool:
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return is_number and math.isfinite(value) and value > 0


#: What the Config docstring allows for each field, given the architecture.
RULES: dict[str, Callable[[Any, str], bool]] = {
    "architecture": lambda v, _: isinstance(v, str) and v in ARCHITECTURES,
    # the other dense syncs are for replicated dense parameters (not under ps/optps)
    "dense_sync": lambda v, arch: isinstance(v, str) and v in DENSE_SYNCS and (
        v in ("hierarchical", "flat") or arch in ("hybrid", "allreduce")),
    # only with dense_sync qsgd/plump/slim (here the default, hierarchical)
    "qsgd": lambda v, _: v is None,
    "slim": lambda v, _: isinstance(v, SlimDP),
    # "2d" needs a mesh (None here); the others split layers beside the hybrid's servers only
    "parallelism": lambda v, arch: isinstance(v, str) and (
        v == "data" or (v in ("model", "auto") and arch == "hybrid")),
    "mesh": lambda v, _: v is None,  # only with parallelism="2d"
    "model_split": lambda v, _: v == "pairs",  # the others only with a split parallelism
    "local_aggregation": lambda v, arch: v is None or v is False
    or (v is True and arch != "allreduce"),
    "sparsity_warmup_steps": lambda v, _: _is_int(v) and v >= 0,
    "alpha_threshold": lambda v, _: v is None or (
        isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1),
    "lazy_sparse_updates": lambda v, _: isinstance(v, bool),
    "overlap_push": lambda v, _: isinstance(v, bool),
    "average_dense": lambda v, _: isinstance(v, bool),
    "average_sparse": lambda v, _: isinstance(v, bool),
    "clip_grad_norm": lambda v, _: v is None or _finite_positive(v),
    # seed 001's placements (sync="sync" here, the default)
    "after_aggregation": lambda v, _: isinstance(v, str) and v in ("servers", "workers"),
    "id_dedup": lambda v, _: isinstance(v, str) and v in ("servers", "workers"),
    "seed": lambda v, _: _is_int(v) and -(2**63) <= v < 2**64,
    "num_partitions": lambda v, _: v is None or (_is_int(v) and v >= 1),
    # names are checked against the model when the tables are built
    "pooled_tables": lambda v, arch: v is None or isinstance(v, (tuple, list)) and all(
        isinstance(n, str) for n in v) and len(set(v)) == len(v) and (
        not v or arch != "allreduce"),
    "pooled_by_rows": lambda v, arch: isinstance(v, (tuple, list)) and all(
        isinstance(n, str) for n in v) and len(set(v)) == len(v) and (
        not v or arch != "allreduce"),
    "pooled_by_columns": lambda v, arch: isinstance(v, (tuple, list)) and all(
        isinstance(n, str) for n in v) and len(set(v)) == len(v) and (
        not v or arch != "allreduce"),
    "sharding": lambda v, arch: v is None or isinstance(v, dict) and all(
        isinstance(k, str) and k and v[k] in ("rows", "pooled", "pooled_by_rows",
                                              "pooled_by_columns") for k in v) and (
        arch != "allreduce" or set(v.values()) <= {"rows"}),
    "link_gbit": lambda v, _: v is None or _finite_positive(v),
    "server_threads": lambda v, _: v is None or (_is_int(v) and v >= 1),
    "partition_search_steps": lambda v, _: _is_int(v) and v >= 2,
    "local_aggregation_trial_steps": lambda v, _: _is_int(v) and (v == 0 or v >= 2),
    "max_partitions": lambda v, _: v is None or (_is_int(v) and v >= 1),
    "partition_cache": lambda v, _: v is None or (
        isinstance(v, (str, os.PathLike)) and os.fspath(v) != ""),
    "checkpoint_dir": lambda v, _: v is None or (
        isinstance(v, (str, os.PathLike)) and os.fspath(v) != ""),
    # without checkpoint_dir (as here), automatic saves cannot be asked for
    "checkpoint_every_steps": lambda v, _: v is None,
    "checkpoint_every_secs": lambda v, _: v is None,
    "checkpoint_keep": lambda v, _: _is_int(v) and v >= 1,
    "resume": lambda v, _: isinstance(v, bool),
    "nonfinite": lambda v, _: isinstance(v, str) and v in NONFINITE,
    "collective_timeout_s": lambda v, _: _finite_positive(v)
    and v < timedelta.max.total_seconds(),
    "find_unused_parameters": lambda v, _: isinstance(v, bool),
    # asynchronous: "async" puts everything on the servers (ps), "async-sparse" is the hybrid's
    "sync": lambda v, arch: isinstance(v, str) and (
        v == "sync" or (v == "async" and arch == "ps") or (v == "async-sparse"
                                                           and arch == "hybrid")),
    "max_staleness": lambda v, _: v is None,  # only with an asynchronous sync
    "log_dir": lambda v, _: v is None or (
        isinstance(v, (str, os.PathLike)) and os.fspath(v) != ""),
    "log_every_steps": lambda v, _: _is_int(v) and v >= 1,
}
FIELDS = [f.name for f in dataclasses.fields(Config)]


def test_every_config_field_has_a_rule():
    assert sorted(set(FIELDS) - set(RULES)) == [], "add a rule (and a valid strategy) here"
    assert sorted(set(RULES) - set(FIELDS)) == [], "a rule for a field Config no longer has"


@PROPERTY
@given(st.sampled_from(sorted(set(FIELDS) & set(RULES))), ANY_VALUE,
       st.sampled_from(ARCHITECTURES), st.booleans())
def test_config_field_constructs_or_names_the_field(field, value, architecture, via_dict):
    values = {"architecture": architecture, field: value}
    build = Config.from_dict if via_dict else (lambda v: Config(**v))
    if RULES[field](value, values["architecture"]):
        config = build(values)
        expected = os.fspath(value) if isinstance(value, os.PathLike) else value
        if (field in ("pooled_tables", "pooled_by_rows", "pooled_by_columns")
                and isinstance(value, list)):
            expected = tuple(value)  # (a list too)
        assert getattr(config, field) == expected
    else:
        with pytest.raises(ConfigError) as err:
            build(values)
        assert str(err.value).startswith(f"Config.{field} must be "), str(err.value)
        assert str(err.value).endswith(f"got {value!r}")


@st.composite
def valid_configs(draw: st.DrawFn) -> Config:
    architecture = draw(st.sampled_from(ARCHITECTURES))
    aggregation = [None, False] + ([True] if architecture != "allreduce" else [])
    positive = st.integers(1, 10**6) | st.floats(1e-6, 1e6)
    strategies = {
        "local_aggregation": st.sampled_from(aggregation),
        "local_aggregation_trial_steps": st.sampled_from([0, 2]) | st.integers(2, 100),
        "sparsity_warmup_steps": st.integers(0, 1000),
        "alpha_threshold": st.none() | st.floats(0, 1) | st.sampled_from([0, 1]),
        "lazy_sparse_updates": st.booleans(),
        "overlap_push": st.booleans(),
        "average_dense": st.booleans(),
        "average_sparse": st.booleans(),
        "clip_grad_norm": st.none() | positive,
        "after_aggregation": st.sampled_from(["servers", "workers"]),
        "id_dedup": st.sampled_from(["workers", "servers"]),
        "seed": st.integers(0, 2**32 - 1),
        "num_partitions": st.none() | st.integers(1, 1024),
        "link_gbit": st.none() | positive,
        "server_threads": st.none() | st.integers(1, 64),
        "partition_search_steps": st.integers(2, 100),
        "max_partitions": st.none() | st.integers(1, 1024),
        "partition_cache": st.none() | st.text(min_size=1, max_size=20),
        "checkpoint_dir": st.none() | st.text(min_size=1, max_size=20),
        "checkpoint_keep": st.integers(1, 10),
        "resume": st.booleans(),
        "nonfinite": st.sampled_from(NONFINITE),
        "collective_timeout_s": positive,
        "find_unused_parameters": st.booleans(),
    }
    values = {name: draw(strategy) for name, strategy in strategies.items() if name in FIELDS}
    replicated = architecture in ("hybrid", "allreduce")
    values["dense_sync"] = draw(st.sampled_from(DENSE_SYNCS if replicated
                                                else ("hierarchical", "flat")))
    if values["dense_sync"] in ("qsgd", "plump", "slim"):
        values["qsgd"] = draw(st.none() | st.builds(QSGD, bits=st.sampled_from([2, 4, 8]),
                                                    bucket_size=st.integers(1, 4096)))
    if values["dense_sync"] in ("plump", "slim"):  # each worker's own gradients
        values["clip_grad_norm"] = values["checkpoint_dir"] = None
    if architecture == "hybrid" and values["dense_sync"] in ("hierarchical", "flat"):
        values["parallelism"] = draw(st.sampled_from(["data", "model", "2d", "auto"]))
        if values["parallelism"] == "2d":
            values["mesh"] = (draw(st.integers(1, 8)), draw(st.integers(1, 8)))
    can_async = (values.get("parallelism", "data") == "data" and not values["local_aggregation"]
                 and values["dense_sync"] not in ("plump", "slim"))
    if can_async and architecture in ("ps", "hybrid") and draw(st.booleans()):
        values["sync"] = "async" if architecture == "ps" else "async-sparse"
        values["max_staleness"] = draw(st.none() | st.integers(0, 100))
        values["after_aggregation"], values["id_dedup"] = "servers", "workers"
        if values["sync"] == "async-sparse":  # no norm every worker agrees on
            values["clip_grad_norm"] = None
    beta = draw(st.just(0.0) | st.floats(1e-3, 1))
    values["slim"] = SlimDP(alpha=draw(st.floats(beta, 1)), beta=beta,
                            reselect_every=draw(st.integers(1, 10**5)),
                            sync_every=draw(st.integers(1, 100)),
                            significance=draw(st.floats(0, 100)))
    return Config(architecture=architecture, **values)


@PROPERTY
@given(valid_configs())
def test_valid_config_round_trips_through_dict_and_json(config):
    assert Config.from_dict(config.to_dict()) == config
    assert Config.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    expected = (config.local_aggregation if config.local_aggregation is not None
                else config.architecture in ("hybrid", "optps")) and config.sync == "sync"
    assert architecture_of(config).aggregates_locally(config) == expected


@PROPERTY
@given(valid_configs(), st.lists(st.text(max_size=12).filter(lambda k: k not in FIELDS),
                                 min_size=1, max_size=3, unique=True))
def test_unknown_keys_are_named(config, unknown):
    values = config.to_dict() | {key: 0 for key in unknown}
    with pytest.raises(ConfigError, match="unknown Config field") as err:
        Config.from_dict(values)
    for key in unknown:
        assert repr(key) in str(err.value)


def test_unknown_keys_of_mixed_types_are_named():
    # YAML 1.1 reads ``yes:`` as the key True, so such mappings do occur.
    with pytest.raises(ConfigError, match="unknown Config field"):
        Config.from_dict({True: 1, "seeed": 2})


@given(st.integers(-(2**70), 2**70))
@settings(max_examples=150, deadline=None, derandomize=True, database=None)
def test_every_accepted_seed_is_usable(seed):
    try:
        config = Config(seed=seed)
    except ConfigError as error:
        assert "Config.seed must be" in str(error)
        return
    torch.Generator().manual_seed(config.seed)  # what torch.manual_seed does, on a copy


@given(st.floats(1e-3, 1e300))
@settings(max_examples=150, deadline=None, derandomize=True, database=None)
def test_every_accepted_timeout_is_usable(seconds):
    try:
        config = Config(collective_timeout_s=seconds)
    except ConfigError as error:
        assert "Config.collective_timeout_s must be" in str(error)
        return
    timedelta(seconds=config.collective_timeout_s)
