"""docs/architecture.md matches the tree: every project path it names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_path_the_architecture_names_exists():
    text = (ROOT / "docs" / "architecture.md").read_text()
    paths = set(re.findall(r"`((?:runtime|tasks|flows|docs|tests|bench)/[\w./]*)`", text))
    assert len(paths) > 40
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_every_package_is_named():
    text = (ROOT / "docs" / "architecture.md").read_text()
    packages = {str(p.parent.relative_to(ROOT)) + "/" for p in ROOT.glob("*/**/__init__.py")
                if p.parts[len(ROOT.parts)] in ("runtime", "tasks", "flows")} - {"runtime/", "tasks/", "flows/"}
    unnamed = sorted(p for p in packages if f"`{p}`" not in text)
    assert not unnamed, f"docs/architecture.md does not name the packages {unnamed}"
