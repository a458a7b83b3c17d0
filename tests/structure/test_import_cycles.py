"""No import cycles among the project's modules: imports at module level and inside functions (a module
importing its own package's `__init__` excluded, since importing a submodule runs it anyway)."""

from __future__ import annotations

import ast

import networkx as nx

from memplan.flows.codehash import PACKAGES, ROOT, module_file


def _modules() -> dict[str, object]:
    """Every module of the `memplan` package by its dotted name (`memplan/` and the folders mapped into it)."""
    found = {}
    for path in [*(ROOT / "memplan").rglob("*.py"), *(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))]:
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = parts[:-1] if parts[-1] == "__init__" else parts
        found[".".join(name if name[0] == "memplan" else ("memplan", *name))] = path
    return found


def test_imports_have_no_cycle():
    modules, graph = _modules(), nx.DiGraph()
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                if target in modules and module_file(target, ROOT) is not None and target != name \
                        and not name.startswith(target + "."):
                    graph.add_edge(name, target)
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, f"import cycles: {cycles[:5]}"


def test_layers_import_only_downward():
    """runtime/ imports neither tasks/ nor flows/; tasks/ does not import flows/ (docs/architecture.md)."""
    above = {"runtime": ("tasks", "flows"), "tasks": ("flows",)}
    for name, path in _modules().items():
        layer = name.split(".")[1] if name.count(".") else ""
        for node in ast.walk(ast.parse(path.read_text())):
            targets = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] + [f"{node.module}.{a.name}" for a in node.names] \
                if isinstance(node, ast.ImportFrom) and node.module else []
            for target in targets:
                parts = target.split(".")
                assert not (parts[0] == "memplan" and len(parts) > 1 and parts[1] in above.get(layer, ())), \
                    f"{name} imports {target}"
