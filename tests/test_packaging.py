"""pyproject.toml keeps the promises the code makes: `requires-python` is at least the newest
standard-library API the package uses, and this interpreter satisfies it."""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Standard-library names by the Python version that introduced them (those a server reaches for).
NEWER_STDLIB = {
    "asyncio.Runner": (3, 11), "asyncio.TaskGroup": (3, 11), "asyncio.timeout": (3, 11),
    "asyncio.timeout_at": (3, 11), "typing.Self": (3, 11), "typing.assert_never": (3, 11),
    "enum.StrEnum": (3, 11), "datetime.UTC": (3, 11), "tomllib": (3, 11),
    "ExceptionGroup": (3, 11), "itertools.batched": (3, 12), "typing.override": (3, 12),
    "warnings.deprecated": (3, 13), "copy.replace": (3, 13),
}


def _requires_python() -> tuple[int, int]:
    spec = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert spec.startswith(">="), spec
    major, minor = spec.removeprefix(">=").split(".")[:2]
    return int(major), int(minor)


def _names_used(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            names.add(f"{node.value.id}.{node.attr}")
        elif isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.update(f"{node.module}.{a.name}" for a in node.names)
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_requires_python_covers_every_api_used():
    minimum = _requires_python()
    too_new = {}
    for path in sorted((ROOT / "service" / "tinyvllm").rglob("*.py")):
        tree = ast.parse(path.read_text(), feature_version=minimum)  # syntax of the minimum too
        for name in _names_used(tree) & NEWER_STDLIB.keys():
            if NEWER_STDLIB[name] > minimum:
                too_new[f"{path.relative_to(ROOT)}: {name}"] = NEWER_STDLIB[name]
    assert not too_new, f"requires-python >={minimum} but the code uses {too_new}"


def test_this_interpreter_satisfies_requires_python():
    assert sys.version_info[:2] >= _requires_python()
