"""memplan installs as one package: the checkout's rooms are `memplan.runtime`, `memplan.tasks` and
`memplan.flows`, and nothing generic lands at the top level of site-packages, so a user's own `runtime/` or
`tasks.py` shadows nothing of ours."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_no_generic_top_level_package_is_importable_from_the_install():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = ("import importlib.util, sys; sys.path = [p for p in sys.path if p not in ('', '.')]; "
            "print([n for n in ('runtime', 'tasks', 'flows') if importlib.util.find_spec(n)])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd="/",
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    assert importlib.util.find_spec("memplan.runtime").origin == str(ROOT / "runtime" / "__init__.py")


def test_a_users_own_runtime_and_tasks_do_not_shadow_memplan(tmp_path):
    (tmp_path / "runtime").mkdir()
    (tmp_path / "runtime" / "__init__.py").write_text("MINE = True\n")
    (tmp_path / "tasks.py").write_text("MINE = True\n")
    code = ("import runtime, tasks, memplan; assert runtime.MINE and tasks.MINE; "
            "import memplan.runtime, memplan.tasks.config; print(memplan.load.__module__, memplan.Plan.__name__)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["memplan.runtime.execute.executor", "Plan"]


def test_every_room_is_a_subpackage_of_memplan():
    rooms = {str(p.parent.relative_to(ROOT)).replace("/", ".") for room in ("runtime", "tasks", "flows")
             for p in (ROOT / room).rglob("__init__.py")}
    for room in sorted(rooms):
        spec = importlib.util.find_spec(f"memplan.{room}")
        assert spec is not None and spec.origin == str(ROOT / room.replace(".", "/") / "__init__.py"), room
