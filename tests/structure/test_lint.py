"""The code passes ruff (pyproject's [tool.ruff]: pyflakes and pycodestyle's E4/E7/E9, named there) with the ruff the
test extra pins, so CI's test command lints: an unused import, an f-string without placeholders or an undefined name
fails here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("memplan", "runtime", "tasks", "flows", "bench", "tests")
RUFF = Path(sys.executable).with_name("ruff")
"""The venv's ruff (installed with '.[test]'; constraints.txt pins its version, tests/pipeline/test_install.py)."""


def test_ruff_check_passes():
    assert RUFF.exists(), (f"no ruff beside {sys.executable}: install the test extra "
                           f"(`pip install -c constraints.txt -e '.[test]'`)")
    done = subprocess.run([str(RUFF), "check", "--no-cache", "--output-format", "concise", *FOLDERS],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, f"`ruff check {' '.join(FOLDERS)}` found:\n{done.stdout}{done.stderr}"
