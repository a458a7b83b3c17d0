"""The fast lane's list (tests/conftest.py's SLOW, docs/install.md) names tests that exist: a renamed or moved slow
test would otherwise fall silently into the fast lane. Read from the source, so no test module is imported here."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _slow() -> dict[str, str | tuple[str, ...]]:
    tree = ast.parse((ROOT / "tests" / "conftest.py").read_text())
    value, = (node.value for node in tree.body if isinstance(node, ast.AnnAssign) and node.target.id == "SLOW")
    return ast.literal_eval(value)


def _tests(module: Path) -> set[str]:
    """The test functions a module defines at its top level."""
    return {node.name for node in ast.parse(module.read_text()).body
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test_")}


def test_every_slow_entry_names_a_test_module_and_its_tests_and_says_why():
    slow = _slow()
    assert slow, "tests/conftest.py's SLOW is empty"
    wrong = []
    for path, entry in slow.items():
        module = ROOT / path
        if not (path.startswith("tests/") and module.name.startswith("test_") and module.is_file()):
            wrong.append(f"{path}: no such test module")
            continue
        why, *tests = (entry,) if isinstance(entry, str) else entry
        if not why.strip():
            wrong.append(f"{path}: says not why it is slow")
        if not isinstance(entry, str) and not tests:
            wrong.append(f"{path}: names no test (a module's path alone marks all of it)")
        defined = _tests(module)
        wrong += [f"{path}::{test}: no such test" for test in tests if test.split("[", 1)[0] not in defined]
        wrong += [f"{path}::{test}: named twice" for test in set(tests) if tests.count(test) > 1]
    assert not wrong, wrong
