"""The code passes ruff (pyproject's [tool.ruff]: pyflakes and pycodestyle's E4/E7/E9, named there) with the ruff the
test extra pins, so CI's test command lints: an unused import, an f-string without placeholders or an undefined name
fails here. The torch-free solver core and the plan/graph formats pass mypy (pyproject's [tool.mypy]) likewise."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("memplan", "runtime", "tasks", "flows", "bench", "tests")
RUFF = Path(sys.executable).with_name("ruff")
"""The venv's ruff (installed with '.[test]'; constraints.txt pins its version, tests/pipeline/test_install.py)."""
MYPY = Path(sys.executable).with_name("mypy")
"""The venv's mypy, likewise."""
ROOMS = ("runtime", "tasks", "flows")
"""The folders setup.py installs as memplan's sub-packages (memplan.runtime -> runtime/, ...)."""


def test_ruff_check_passes():
    assert RUFF.exists(), (f"no ruff beside {sys.executable}: install the test extra "
                           f"(`pip install -c constraints.txt -e '.[test]'`)")
    done = subprocess.run([str(RUFF), "check", "--no-cache", "--output-format", "concise", *FOLDERS],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, f"`ruff check {' '.join(FOLDERS)}` found:\n{done.stdout}{done.stderr}"


def _package_tree(folder: Path) -> Path:
    """`folder` holding memplan/ as links to memplan/__init__.py and the rooms: the `memplan` package laid out as
    mypy can find it on MYPYPATH (it does not follow the editable install's import hook, which maps the rooms)."""
    package = folder / "memplan"
    package.mkdir()
    (package / "__init__.py").symlink_to(ROOT / "memplan" / "__init__.py")
    for room in ROOMS:
        (package / room).symlink_to(ROOT / room, target_is_directory=True)
    return folder


def test_mypy_passes_on_the_solver_core(tmp_path):
    assert MYPY.exists(), (f"no mypy beside {sys.executable}: install the test extra "
                           f"(`pip install -c constraints.txt -e '.[test]'`)")
    tree = _package_tree(tmp_path)
    env = {**os.environ, "MYPYPATH": str(tree)}
    done = subprocess.run([str(MYPY)], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    report = (done.stdout + done.stderr).replace(f"{tree / 'memplan'}{os.sep}", "")   # paths as in the checkout
    assert done.returncode == 0, f"`mypy` (pyproject's [tool.mypy]) found:\n{report}"
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["packages"]
    folders = [ROOT / Path(*name.split(".")[1:]) for name in packages]
    sources = sum(len(list(folder.rglob("*.py"))) for folder in folders)
    assert f"in {sources} source files" in done.stdout, (                  # "Success: no issues found in N ..."
        f"mypy did not check the {sources} modules of {', '.join(map(str, folders))}:\n{report}")
