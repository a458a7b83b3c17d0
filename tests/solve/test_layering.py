"""The solver layer is torch-free and documented from its registry."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import memplan.tasks.solve

ROOT = Path(__file__).parents[2]
HEAVY = ("torch", "pyarrow", "duckdb")


def test_no_solver_module_imports_torch_pyarrow_or_duckdb():
    """Each module under tasks/solve/, imported in order in a fresh interpreter: none of them pulls in
    a heavy library, directly or transitively (the first offender is named)."""
    modules = ["memplan.tasks.solve"] + [m.name for m in pkgutil.walk_packages(memplan.tasks.solve.__path__, "memplan.tasks.solve.")]
    assert len(modules) > 15
    code = ("import importlib, sys\n"
            f"for name in {modules!r}:\n"
            "    importlib.import_module(name)\n"
            f"    heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
            "    if heavy:\n"
            "        sys.exit(f'{name} imports {heavy}')\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr or done.stdout


def test_a_heavy_import_would_be_caught(tmp_path):
    """The check above can fail: a module importing pyarrow is reported."""
    (tmp_path / "leaky.py").write_text("import pyarrow\n")
    code = ("import sys; sys.path.insert(0, %r); import leaky; "
            "sys.exit('leaky imports pyarrow' if 'pyarrow' in sys.modules else 0)" % str(tmp_path))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "leaky imports pyarrow" in done.stderr


def test_solver_docs_are_generated_from_the_registry():
    from memplan.tasks.solve.__main__ import catalogue

    assert (ROOT / "docs" / "solvers.md").read_text() == catalogue(), \
        "docs/solvers.md is stale: run `python -m memplan.tasks.solve > docs/solvers.md`"
