"""What pyproject.toml declares covers what the package needs at run time.

numpy is a runtime dependency although no module of ours imports it: without it ``import torch``
prints a "Failed to initialize NumPy" warning into every benchmark run, and the checkpoint writer
reads tensor bytes through ``.numpy()`` (migration/_writer.py).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
tomllib = pytest.importorskip("tomllib")  # Python 3.11+


def declared() -> tuple[set[str], set[str]]:
    """Distribution names of the runtime dependencies, and of every optional extra together."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = {Requirement(text).name for text in project["dependencies"]}
    extras = {Requirement(text).name for group in project["optional-dependencies"].values() for text in group}
    return runtime, extras


def third_party_imports() -> dict[str, str]:
    """Top-level names of the non-standard-library modules our sources import, with one importer each."""
    found = {}
    for folder in ("slim_mha", "migration"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top != "slim_mha":
                        found.setdefault(top, str(path.relative_to(ROOT)))
    return found


def test_numpy_is_a_runtime_dependency():
    runtime, _ = declared()
    assert "numpy" in runtime


def test_every_third_party_import_is_declared():
    runtime, extras = declared()
    undeclared = {name: importer for name, importer in third_party_imports().items() if name not in runtime | extras}
    assert not undeclared, f"imported but declared nowhere in pyproject.toml: {undeclared}"
    assert "torch" in third_party_imports()  # the scan itself finds imports


def test_importing_the_benchmark_prints_no_numpy_warning():
    """What a user of ``python -m slim_mha.bench`` sees first: torch's import, with numpy present."""
    completed = subprocess.run(
        [sys.executable, "-c", "import slim_mha.bench.__main__, slim_mha.migration"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert "NumPy" not in completed.stderr + completed.stdout


# ------------------------------------------------------------------------------ import direction


def _module_name(path: Path) -> str:
    """``slim_mha/attention.py`` -> ``slim_mha.attention``; ``migration/cli.py`` -> ``slim_mha.migration.cli``."""
    relative = path.relative_to(ROOT).with_suffix("")
    parts = list(relative.parts)
    if parts[0] == "migration":
        parts = ["slim_mha", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def internal_imports() -> dict[str, set[str]]:
    """Each of our modules -> our modules it imports anywhere, inside functions too."""
    modules = {}
    for folder in ("slim_mha", "migration"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            modules[_module_name(path)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                # ``from . import _mode`` imports the submodule; ``from .x import y`` imports x (and y,
                # if y is itself a submodule of x).
                targets = ([base] if node.module else []) + [f"{base}.{alias.name}" for alias in node.names]
            edges |= {target for target in targets if target in modules and target != name}
        graph[name] = edges
    return graph


def test_no_import_cycles_counting_imports_inside_functions():
    graph = internal_imports()
    assert "slim_mha.attention" in graph and "slim_mha.migration.cli" in graph
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        stack.append(name)
        for target in sorted(graph[name]):
            # A package's __init__ is imported by its submodules' import: a submodule importing its own
            # package is not a cycle unless the package imports it back, which the walk sees.
            if state.get(target) == 1:
                cycle = stack[stack.index(target) :] + [target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if state.get(target) is None:
                visit(target)
        stack.pop()
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)


def test_every_package_folder_is_listed_for_the_wheel():
    """pyproject.toml lists packages by hand: a folder left off would install from a checkout and be
    missing from the wheel users install."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {".".join(path.parent.relative_to(ROOT).parts) for path in (ROOT / "slim_mha").rglob("__init__.py")} | {
        "slim_mha.migration" for path in (ROOT / "migration").glob("__init__.py")
    }
    assert set(setuptools["packages"]) == folders
    assert setuptools["package-dir"] == {"slim_mha.migration": "migration"}
