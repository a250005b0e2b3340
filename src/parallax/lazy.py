"""A package's submodules as its attributes, imported on first use (PEP 562).

``import parallax`` imports no submodule (see ``parallax/__init__.py``: the processes that only
start others must not pay for torch), so ``parallax.cluster`` or
``parallax.launch.elastic.install_error_recorder`` would otherwise exist only after something
imported that module. Each package sets ``__getattr__ = submodule_attributes(__name__)``.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from types import ModuleType


def submodule_attributes(package: str) -> Callable[[str], ModuleType]:
    """A module ``__getattr__`` for ``package`` that imports and returns its submodule
    ``name``, and raises AttributeError for any other missing name."""

    def __getattr__(name: str) -> ModuleType:
        if not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}"):
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
