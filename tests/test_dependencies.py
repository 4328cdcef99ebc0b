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
