"""The package's shape: no import cycles, each layer importing only the layers below it, and a
wheel that holds the library alone (the demo corpora live in examples/)."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"

# Lowest first. A module may import its own layer and the layers below; cycles inside a layer
# are caught by the cycle check. Prefixes name a module and everything under it.
LAYERS = [
    # nothing of ours, or only each other
    ["parallax.runs"],
    ["parallax.errors", "parallax.checks", "parallax.collective", "parallax.cluster",
     "parallax.config", "parallax.loader",
     "parallax.verify.record", "parallax.logs", "parallax.atomic", "parallax.lazy"],
    ["parallax.engine"],
    ["parallax.launch"],
    ["parallax.model"],
    ["parallax.partitions"],
    ["parallax.planning"],
    ["parallax.parallelism"],
    ["parallax.checkpoint"],
    ["parallax.session", "parallax.metrics"],
    ["parallax.step"],
    ["parallax.runner"],
    ["parallax.api", "parallax.verify.run", "parallax.verify.reference"],
    ["parallax.distributed"],
    ["parallax.cli", "parallax", "parallax.verify"],
]


def modules() -> dict[str, Path]:
    found = {}
    for path in (SRC / "parallax").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports() -> dict[str, set[str]]:
    """Every module of ours each module imports, at any depth of its code (an import inside a
    function is still a dependency: that is how cycles hide)."""
    known = modules()
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                    node.module.split(".")[0] == "parallax":
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    found.add(full if full in known else node.module)
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.split(".")[0] == "parallax"}
        graph[name] = {m for m in found if m in known and m != name}
    return graph


def layer_of(module: str) -> int:
    best, where = -1, None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, where = len(prefix), index
    assert where is not None, f"{module} is in no layer: add it to LAYERS"
    return where


def test_no_import_cycles() -> None:
    graph = imports()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for dep in sorted(graph[module]):
            if state.get(dep) == 1:
                cycle = path[path.index(dep):] + [dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (found := visit(dep)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def folder_of(module: str) -> str:
    """A module's folder (``parallax.engine.tables``), or the module itself when it is one
    file of the top level or a layer of its own in `LAYERS` (``parallax.verify.record``)."""
    if any(module == prefix for layer in LAYERS for prefix in layer):
        return module
    parts = module.split(".")
    for depth in range(len(parts), 1, -1):  # a package's own module is its folder
        if (SRC.joinpath(*parts[:depth])).is_dir():
            return ".".join(parts[:depth])
    return module


def test_no_folder_loop() -> None:
    """The folders read top-down too: no folder imports one that imports it back (checkpoint
    -> planning -> partitions -> checkpoint was one)."""
    graph: dict[str, set[str]] = {}
    for module, deps in imports().items():
        for dep in deps:
            if folder_of(module) != folder_of(dep):
                graph.setdefault(folder_of(module), set()).add(folder_of(dep))
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_each_layer_imports_only_layers_below() -> None:
    upward = [f"{module} (layer {layer_of(module)}) imports {dep} (layer {layer_of(dep)})"
              for module, deps in sorted(imports().items()) for dep in sorted(deps)
              if layer_of(dep) > layer_of(module)]
    assert not upward, "\n".join(upward)


def test_wheel_holds_the_library_alone(tmp_path: Path) -> None:
    # Built from a copy: setuptools reuses a checkout's build/ folder, which can still hold
    # modules that no longer exist.
    source = tmp_path / "source"
    shutil.copytree(SRC, source / "src", ignore=shutil.ignore_patterns(
        "__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path), str(source)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("parallax_torch-*.whl")
    names = {n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".py")}
    expected = {f"{path.relative_to(SRC)}" for path in modules().values()}
    assert names == expected
    assert not any("corpora" in n or "/data/" in n for n in names)
