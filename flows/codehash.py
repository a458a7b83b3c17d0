"""Cache keys hash what a stage runs: the sources of its module's import closure within the project.

`import_closure(("memplan.tasks.solve_stage",))` follows every import statement of the project's packages
(top-level and inside functions) and every string literal naming a project module (`importlib.import_module`, the
lazy exports of `runtime/__init__.py`), so an edit to any file a stage can execute changes its key and
no stale profile, solution or validation is served (tests/structure/test_cache_keys.py).
"""

from __future__ import annotations

import ast
import hashlib
import threading
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("runtime", "tasks", "flows")

STAGE_MODULES = {"profile": ("memplan.tasks.profile.stage", "memplan.tasks.trace"),
                 "reference": ("memplan.tasks.validate.reference",), "solve": ("memplan.tasks.solve_stage",),
                 "validate": ("memplan.tasks.validate.stage",), "compiled_search": ("memplan.tasks.compiled.policy_cell",),
                 "compiled_plans": ("memplan.tasks.compiled.plans",)}
"""The modules each cached stage runs (flows/steps.py keys each stage by their closure)."""

_PARSING = threading.Lock()
"""Stage cells compute keys on several threads at once, and CPython 3.11's `ast.parse` is not thread-safe
("SystemError: AST constructor recursion depth mismatch"): one parse at a time."""


def module_file(module: str, root: Path) -> Path | None:
    """The source file of project module `module` under `root` (a package's `__init__.py`), or None.

    `memplan` is `memplan/`; its sub-packages `memplan.runtime`, `memplan.tasks` and `memplan.flows` are the
    checkout's top-level folders (pyproject's package-dir)."""
    parts = module.split(".")
    if parts[0] != "memplan":
        return None
    base = root.joinpath(*parts[1:]) if len(parts) > 1 and parts[1] in PACKAGES else root.joinpath(*parts)
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


@lru_cache(maxsize=None)
def _named_modules(path: Path, module: str, mtime_ns: int) -> frozenset[str]:
    """Modules `path` may import: import statements, `from X import name` submodules, and string literals
    naming a module, each with its parent packages (importing `a.b` runs `a/__init__.py`). A package's
    `__init__.py` counts what runs when it is imported, not the imports inside its functions (lazy exports such
    as `memplan.plan`, which no stage calls)."""
    names: set[str] = set()
    with _PARSING:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    for node in _nodes(tree, skip_functions=path.name == "__init__.py"):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".")[: len(module.split(".")) - node.level + (path.name == "__init__.py")]
                base = ".".join(package + ([base] if base else []))
            names |= {base} | {f"{base}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.split(".")[0] == "memplan":
            names.add(node.value)
    return frozenset(".".join(n.split(".")[:i]) for n in names for i in range(1, n.count(".") + 2))


def _nodes(tree: ast.AST, skip_functions: bool):
    """The nodes of `tree`, without the bodies of functions when `skip_functions`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if not (skip_functions and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))):
            stack.extend(ast.iter_child_nodes(node))


def import_closure(modules: tuple[str, ...], root: Path | None = None) -> list[Path]:
    """The project source files `modules` import, directly or through others, themselves included (sorted)."""
    root = root or ROOT
    seen: dict[str, Path] = {}
    stack = list(modules)
    while stack:
        name = stack.pop()
        path = module_file(name, root)
        if path is None or name in seen:
            continue
        seen[name] = path
        stack += sorted(_named_modules(path, name, path.stat().st_mtime_ns))
    return sorted(set(seen.values()))


def code_hash(stage: str, root: Path | None = None) -> str:
    """SHA-256 over the relative paths and contents of the import closure of `stage`'s modules."""
    root = root or ROOT
    digest = hashlib.sha256()
    for path in import_closure(STAGE_MODULES[stage], root):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()
