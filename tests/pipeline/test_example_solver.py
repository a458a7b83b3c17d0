"""Adding a solver, checked: the one-file solver of example_solver.py plus one registry line runs
through `memplan run` (trace, profile with variants, solve with greedy addresses, validate in both modes,
publish), `memplan solve` and `runtime.load`, and its plan (which picks implementation variants) trains
exactly like eager PyTorch."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

MODEL = '''
import torch
from torch import nn


class WideReLU(nn.Module):
    """relu(x W) summed in groups: the sum's backward does not read the ReLU output, so a ReLU whose
    backward reads a 1-byte mask lets the 4-byte output go right after the sum."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 512)

    def forward(self, x):
        return torch.relu(self.l(x)).view(-1, 4, 128).sum(-1)
'''

PIPELINE = '''
device = "cpu"

[[models]]
name = "wide"
factory = "widenet:WideReLU"
batch_sizes = [64]
inputs = [{ shape = [8] }, { shape = [], dtype = "int64", high = 4 }]

[profile]
warmup = 1
repeats = 1

[[plans]]
solver = "example-variants"
budgets = [1.0]
addresses = "greedy"

[validate]
steps = 1
max_steps = 1
warmup = 0
'''


@pytest.fixture
def example(monkeypatch):
    """example_solver.py registered as `example-variants`: the one registry line."""
    from memplan.tasks.solve import SOLVERS, SolverSpec

    spec = importlib.util.spec_from_file_location("example_solver", Path(__file__).with_name("example_solver.py"))
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    monkeypatch.setitem(SOLVERS, "example-variants", SolverSpec(
        "example-variants", module.example_variants, "default order, every variant that lowers the peak.",
        module.ExampleOptions, variants=True))
    return module


def _eager_and_plan_grads(plan, folder: Path):
    from memplan import runtime

    sys.path.insert(0, str(folder))
    try:
        from widenet import WideReLU
    finally:
        sys.path.remove(str(folder))
    torch.manual_seed(0)
    model = WideReLU()
    batch = (torch.randn(64, 8), torch.randint(0, 4, (64,)))
    loss_fn = lambda m, x, y: torch.nn.functional.cross_entropy(m(x), y)  # noqa: E731
    loss_fn(model, *batch).backward()
    eager = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    runtime.load(plan, model, loss_fn)(*batch)
    return eager, [p.grad for p in model.parameters()]


def test_a_new_solver_runs_through_run_solve_and_load(tmp_path, example, harness):
    from typer.testing import CliRunner

    from memplan.flows.cli import app
    from memplan.flows.plan import run_plan
    from memplan.runtime.format.plan import Plan

    (tmp_path / "widenet.py").write_text(MODEL)
    (tmp_path / "pipeline.toml").write_text(PIPELINE)
    outcome, = run_plan(tmp_path / "pipeline.toml")
    assert outcome["status"] == "published", outcome["message"]
    published = Plan.load(tmp_path / "plans" / f"{outcome['plan_id']}.json")
    assert published.impls() & {"mask", "bitmask"}         # a profiled variant was chosen
    assert outcome["predicted_peak_bytes"] < outcome["checkpoint_all_peak_bytes"]
    assert published.addresses and outcome["arena_peak_bytes"] > 0     # validated in arena mode too

    graph_file, = (tmp_path / ".cache" / "memplan" / "graphs").glob("*.json")
    out = tmp_path / "solved.json"
    result = CliRunner().invoke(app, ["solve", "--graph", str(graph_file), "--solver", "example-variants",
                                      "--budget", "1.0", "--store", str(tmp_path / "profiles_db"),
                                      "--option", "variants=true", "--json", "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    plan = Plan.load(out)
    assert plan.schedule == published.schedule and report["predicted_peak_bytes"] == plan.predicted["peak_bytes"]
    assert plan.addresses is None                                          # --addresses defaults to none
    assert plan.predicted["time_ms"] == plan.predicted["compute_cost"]  # profiled milliseconds
    eager, planned = _eager_and_plan_grads(plan, tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(eager, planned))

    refused = CliRunner().invoke(app, ["solve", "--graph", str(graph_file), "--solver", "example-variants",
                                       "--budget", "1.0", "--store", str(tmp_path / "profiles_db"),
                                       "--option", "variants=maybe"])
    assert refused.exit_code != 0 and "variants" in refused.output
