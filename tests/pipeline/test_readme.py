"""The README's training snippet runs as written against a plan at the path it names."""

import contextlib
import io
import re
from pathlib import Path

import torch
import torch.nn.functional as F
import torchvision

from memplan import runtime
from memplan.tasks.solve import solve
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import default_schedule, simulate

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_snippet_trains_three_steps_with_a_plan(tmp_path, monkeypatch):
    code = re.search(r"## Train with a plan\n\n```python\n(.*?)```", README.read_text(), re.S).group(1)
    plan_path = re.search(r'memplan\.load\("([^"]+)"', code).group(1)
    model = torchvision.models.resnet18(num_classes=10)
    batch = (torch.randn(8, 3, 64, 64), torch.randint(0, 10, (8,)))
    graph = runtime.capture(model, lambda m, x, y: F.cross_entropy(m(x), y), batch)
    problem = Problem.from_graph(graph)
    budget = int(0.93 * simulate(problem, default_schedule(problem)).peak_bytes)
    solution = solve(problem, "ap-greedy", budget)
    assert solution.feasible
    solution.to_plan(problem).save(tmp_path / plan_path)
    monkeypatch.chdir(tmp_path)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, str(README), "exec"), {"__name__": "readme"})
    losses = [float(line) for line in printed.getvalue().split()]
    assert len(losses) == 3 and losses[2] < losses[0]
