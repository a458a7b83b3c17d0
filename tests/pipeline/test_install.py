"""Installs are reproducible: the README's commands and CI install the versions in constraints.txt, and the
environment the tests run in is that environment (a fresh resolve picking up a new major of a transitive
dependency, such as SQLAlchemy 2.1 under Prefect 3.8, fails here rather than on a user's machine). The Python
version pyproject.toml requires is the README's and the least the code's syntax and standard library need."""

import ast
import importlib
import platform
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PIN = re.compile(r"^([A-Za-z0-9_.\-]+)==([^\s;#]+)\s*$")
PACKAGES = ("memplan", "runtime", "tasks", "flows")
"""The folders the `memplan` distribution installs (setup.py)."""

NEWER_STDLIB = {
    "tomllib": (3, 11), "builtins.ExceptionGroup": (3, 11), "typing.Self": (3, 11), "enum.StrEnum": (3, 11),
    "datetime.UTC": (3, 11), "contextlib.chdir": (3, 11), "asyncio.TaskGroup": (3, 11),
    "itertools.batched": (3, 12), "typing.override": (3, 12), "sys.monitoring": (3, 12),
    "warnings.deprecated": (3, 13), "typing.TypeIs": (3, 13), "copy.replace": (3, 13),
    "annotationlib": (3, 14), "compression": (3, 14), "string.templatelib": (3, 14),
}
"""Standard-library names added after Python 3.10, by the version that added them (checked against the running
interpreter below): those a change is likeliest to reach for."""


def _normal(name: str) -> str:
    """A distribution name in PEP 503's normal form."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            match = PIN.match(line)
            assert match, f"constraints.txt line {line!r} is not `name==version`"
            pins[_normal(match[1])] = match[2]
    return pins


def _installed(name: str) -> bool:
    try:
        metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def _setup_section() -> str:
    return re.search(r"^## Set up\n(.*?)^## ", (ROOT / "README.md").read_text(), re.S | re.M).group(1)


def _setup_commands() -> list[str]:
    return re.findall(r"```bash\n(.*?)\n```", _setup_section(), re.S)


def test_readme_and_ci_install_with_the_constraints():
    commands = _setup_commands()
    assert len(commands) == 2, "the README's Set up section holds the two set-up commands"
    ci = (ROOT / ".ci" / "run").read_text()
    for command in [*commands, ci]:
        for install in re.findall(r"pip install[^&\n]*", command):
            assert "-c constraints.txt" in install, f"{install!r} does not install from constraints.txt"
    assert commands[1] in ci, ".ci/run runs the README's test command"
    assert "[test]" not in commands[0], "the main job installs without the test extras"


def test_the_installed_environment_is_the_constrained_one():
    pins = _pins()
    mismatched = {name: (metadata.version(name), pinned) for name, pinned in pins.items()
                  if _installed(name) and Version(metadata.version(name)) != Version(pinned)}
    assert not mismatched, f"installed versions differ from constraints.txt (installed, pinned): {mismatched}"
    required = [Requirement(r) for r in metadata.requires("memplan") or []]
    missing = sorted(r.name for r in required if r.marker is None and _normal(r.name) not in pins)
    assert not missing, f"constraints.txt pins no version of {missing}; refresh it (docs/install.md)"


def test_the_constraints_satisfy_the_projects_caps():
    pins = _pins()
    for requirement in map(Requirement, metadata.requires("memplan") or []):
        pinned = pins.get(_normal(requirement.name))
        if pinned is not None and requirement.marker is None:
            assert requirement.specifier.contains(pinned, prereleases=True), (
                f"constraints.txt pins {requirement.name}=={pinned}, outside pyproject's {requirement}")


def _requires_python() -> SpecifierSet:
    return SpecifierSet(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"])


def _minimum_python() -> tuple[int, int]:
    """The `>=X.Y` of pyproject's requires-python."""
    floors = [Version(s.version).release[:2] for s in _requires_python() if s.operator == ">="]
    assert len(floors) == 1, f"requires-python {_requires_python()} names no single `>=` minimum"
    return floors[0]


def _resolves(name: str) -> bool:
    """Whether the dotted standard-library `name` (a module, or a module's attribute) exists here."""
    try:
        importlib.import_module(name)
    except ImportError:
        module, _, attribute = name.rpartition(".")
        return bool(module) and _resolves(module) and hasattr(importlib.import_module(module), attribute)
    return True


def _stdlib_names(tree: ast.AST) -> set[str]:
    """The dotted names a module imports or reads: `import a.b`, `from a import b` (a.b), `a.b` where `a` is
    an imported module, and builtins (`builtins.X`)."""
    modules = {alias.asname or alias.name: alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
               for alias in node.names}
    names = set(modules.values())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            names.add(f"{modules[node.value.id]}.{node.attr}")
        elif isinstance(node, ast.Name):
            names.add(f"builtins.{node.id}")
    return names


def test_requires_python_admits_this_interpreter_and_is_the_readmes():
    assert _requires_python().contains(platform.python_version()), (
        f"Python {platform.python_version()} is outside pyproject's requires-python {_requires_python()}")
    stated = re.search(r"\(Python (\d+)\.(\d+)\+", _setup_section())
    assert stated and (int(stated[1]), int(stated[2])) == _minimum_python(), (
        f"the README's Set up section does not state Python {'.'.join(map(str, _minimum_python()))}+")


def test_the_newer_standard_library_table_matches_this_interpreter():
    for name, added in NEWER_STDLIB.items():
        assert _resolves(name) == (sys.version_info[:2] >= added), (name, added)


def test_no_installed_module_needs_a_python_newer_than_requires_python():
    minimum = _minimum_python()
    too_new = []
    for path in sorted(p for folder in PACKAGES for p in (ROOT / folder).rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path), feature_version=minimum)  # SyntaxError: file, line
        too_new += [f"{path.relative_to(ROOT)}: {name} (Python {'.'.join(map(str, NEWER_STDLIB[name]))})"
                    for name in sorted(_stdlib_names(tree) & set(NEWER_STDLIB))
                    if NEWER_STDLIB[name] > minimum]
    assert not too_new, f"requires-python is >={'.'.join(map(str, minimum))}, but: {too_new}"
