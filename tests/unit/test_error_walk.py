"""Every error parallax raises on purpose is a `ParallaxError` (each also the built-in it
specialises): a walk over the package's ``raise`` statements finds no bare built-in."""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

import parallax

SRC = Path(__file__).resolve().parents[2] / "src" / "parallax"
# NotImplementedError marks an abstract method (Python's idiom), not an error of a program.
BUILTIN_ERRORS = {name for name, value in vars(builtins).items()
                  if isinstance(value, type) and issubclass(value, BaseException)
                  and name != "NotImplementedError"}


def raised_name(node: ast.Raise) -> str | None:
    """The class a ``raise`` statement names (``raise X(...)`` or ``raise X``); None for a
    re-raise (``raise``, ``raise error``) of something caught."""
    target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
    return target.id if isinstance(target, ast.Name) else None


def protocol_raises(tree: ast.AST) -> set[ast.Raise]:
    """``raise AttributeError`` inside a ``__getattr__``: Python's protocol for a missing
    attribute (``hasattr`` and ``getattr(x, name, default)`` catch exactly that class)."""
    return {node for function in ast.walk(tree)
            if isinstance(function, ast.FunctionDef) and function.name == "__getattr__"
            for node in ast.walk(function)
            if isinstance(node, ast.Raise) and node.exc is not None
            and raised_name(node) == "AttributeError"}


def test_no_raise_of_a_bare_builtin_exception() -> None:
    bare = []
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        allowed = protocol_raises(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and node.exc is not None and node not in allowed:
                name = raised_name(node)
                if name in BUILTIN_ERRORS:
                    bare.append(f"{path.relative_to(SRC.parent)}:{node.lineno}: raise {name}")
    assert not bare, "raise a parallax.errors class instead:\n" + "\n".join(bare)


def test_the_walk_sees_the_package_raises() -> None:
    """The walk is not vacuous: it finds hundreds of raises, of parallax's own classes."""
    names = [raised_name(node) for path in SRC.rglob("*.py")
             for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Raise)
             and node.exc is not None]
    assert len(names) > 150
    assert {"UnsupportedProgramError", "ArgumentError", "InternalError"} <= set(names)
    assert all(issubclass(getattr(parallax, n), parallax.ParallaxError)
               for n in ("ArgumentError", "ArgumentTypeError", "UsageError", "InternalError"))


def test_a_misspelt_config_field_is_a_config_error_naming_the_nearest() -> None:
    for build, says in ((lambda: parallax.Config(clip_grad_nrom=1.0),
                         "Config has no field 'clip_grad_nrom' (did you mean 'clip_grad_norm'?)"),
                        (lambda: parallax.SlimDP(alfa=0.3),
                         "SlimDP has no field 'alfa' (did you mean 'alpha'?)"),
                        (lambda: parallax.QSGD(bitz=4), "QSGD has no field 'bitz'")):
        try:
            build()
        except parallax.ConfigError as error:
            assert says in str(error)
        else:
            raise AssertionError(says)
    assert parallax.Config(clip_grad_norm=2.0).clip_grad_norm == 2.0  # real fields still work
