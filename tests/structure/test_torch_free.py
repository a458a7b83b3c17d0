"""The solve path needs no torch (docs/architecture.md): `import memplan.tasks.solve` and `memplan solve` on a public
benchmark graph run in a Python whose `import torch` fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
BLOCK = """
import importlib.abc, sys
class _NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")
sys.meta_path.insert(0, _NoTorch())
"""


def _run(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", BLOCK + code], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)


def test_tasks_solve_imports_without_torch():
    done = _run("import memplan.tasks.solve, memplan.tasks.solve_stage, memplan.tasks.problems\nassert 'torch' not in sys.modules")
    assert done.returncode == 0, done.stderr


def test_memplan_solve_runs_on_a_benchmark_graph_without_torch():
    from memplan.tasks.solve.core.benchmarks import benchmark_graphs

    graph = next(p for p in benchmark_graphs() if p.name.startswith("MobileNet") and p.name.endswith("train.json"))
    args = ["solve", "--graph", str(graph), "--solver", "ap-greedy", "--budget", "0.9", "--json"]
    done = _run(f"from memplan.flows.cli import main\nsys.argv = ['memplan'] + {args!r}\nmain()")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["feasible"] is True
