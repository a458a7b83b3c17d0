"""Installs are reproducible: the README's commands and CI install the versions in constraints.txt, and the
environment the tests run in is that environment (a fresh resolve picking up a new major of a transitive
dependency, such as SQLAlchemy 2.1 under Prefect 3.8, fails here rather than on a user's machine)."""

import re
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PIN = re.compile(r"^([A-Za-z0-9_.\-]+)==([^\s;#]+)\s*$")


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


def _setup_commands() -> list[str]:
    section = re.search(r"^## Set up\n(.*?)^## ", (ROOT / "README.md").read_text(), re.S | re.M).group(1)
    return re.findall(r"```bash\n(.*?)\n```", section, re.S)


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
