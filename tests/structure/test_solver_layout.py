"""The solver layout (docs/architecture.md): tasks/solve/core/ imports no solver, and every solver module or
package imports the core only (warm starts and block solvers come from the registry as `peers`)."""

from __future__ import annotations

import ast
from pathlib import Path

SOLVE = Path(__file__).resolve().parents[2] / "tasks" / "solve"


def _solve_imports(path: Path) -> set[str]:
    """Modules under tasks.solve that `path` imports (top-level and inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("memplan.tasks.solve"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("memplan.tasks.solve")}
    return found


def _unit(path: Path) -> str:
    """The solver unit a file belongs to: `core`, a solver package's name, or a single-module solver's."""
    rel = path.relative_to(SOLVE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def test_core_imports_no_solver():
    for path in (SOLVE / "core").rglob("*.py"):
        bad = {m for m in _solve_imports(path) if not m.startswith("memplan.tasks.solve.core")}
        assert not bad, f"{path.name} imports {bad}"


def test_each_solver_imports_the_core_and_itself_only():
    for path in SOLVE.rglob("*.py"):
        unit = _unit(path)
        if unit in ("core", "__init__", "__main__"):
            continue
        own = f"memplan.tasks.solve.{unit}"
        bad = {m for m in _solve_imports(path)
               if not (m.startswith("memplan.tasks.solve.core") or m == own or m.startswith(own + "."))}
        assert not bad, f"{path.relative_to(SOLVE)} imports {bad}"
