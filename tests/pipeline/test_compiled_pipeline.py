"""Compiled-form plans from the pipeline (`[[plans]] form = "compiled"`): the config refuses what the form cannot
take; `memplan run` plans torch.compile's own graph without tracing or profiling it, measures each plan compiled
by inductor, validates it against eager PyTorch, publishes it with its form, and the published plan trains in a
plain loop through `memplan.load` as eager PyTorch does."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch.nn.functional as F

from memplan.tasks.config import ConfigError, expand_matrix, graph_forms, parse_config

LINEAR = {"name": "linear", "factory": "torch.nn:Linear", "kwargs": {"in_features": 4, "out_features": 3},
          "loss": "mse", "inputs": [{"shape": [4]}, {"shape": [3]}]}


def config(**plan):
    return parse_config({"models": [LINEAR], "plans": [{"budgets": [0.8], "solver": "dtr", "form": "compiled"} | plan]},
                        "pipeline.toml")


def test_a_compiled_plan_is_named_by_its_form_and_traces_nothing():
    case, = expand_matrix(config())
    assert case.alias == "linear-b8-dtr-compiled-80pct" and case.plan.plan_form == "compiled"
    assert graph_forms("linear", 8, [case]) == []


@pytest.mark.parametrize("plan, shown", [
    ({"addresses": "greedy"}, 'addresses = "greedy"'), ({"ddp_bucket_mb": 25}, "ddp_bucket_mb = 25"),
    ({"optimizer_in_step": True}, "optimizer_in_step = true"), ({"variants": "none"}, 'variants = "none"'),
    ({"solver": "selective-policy"}, 'solver = "selective-policy"')])
def test_what_inductor_decides_is_refused_in_the_compiled_form(plan, shown):
    with pytest.raises(ConfigError, match=rf"key plans\[0\]: plan of solver .* sets form = \"compiled\" and {shown}.*"
                                          r"form = \"executor\""):
        config(**plan)


MLP = '''
from torch import nn


class MLP(nn.Sequential):
    def __init__(self, width=128, depth=3, classes=8):
        layers = [nn.Linear(32, width), nn.Tanh()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.Tanh()]
        super().__init__(*layers, nn.Linear(width, classes))
'''

PIPELINE = '''
device = "cpu"

[[models]]
name = "mlp"
factory = "mlp:MLP"
loss = "cross_entropy"
batch_sizes = [512]
inputs = [{ shape = [32] }, { shape = [], dtype = "int64", high = 8 }]

[[plans]]
solver = "dtr"
form = "compiled"
budgets = ["100%", "85%", "1%"]

[validate]
steps = 2
max_steps = 2
warmup = 0
compile_probes = 3
'''


@pytest.fixture(scope="module")
def project(tmp_path_factory, harness):
    from memplan.flows.plan import run_plan

    folder = tmp_path_factory.mktemp("compiled-project")
    (folder / "mlp.py").write_text(MLP)
    (folder / "pipeline.toml").write_text(PIPELINE)
    return folder, {o["alias"]: o for o in run_plan(folder / "pipeline.toml")}


def test_each_budget_gets_a_validated_compiled_plan_within_it_or_says_what_was_measured(project):
    folder, outcomes = project
    full, cut, tiny = (outcomes[f"mlp-b512-dtr-compiled-{b}"] for b in ("100pct", "85pct", "1pct"))
    for outcome in (full, cut):
        assert outcome["status"] == "published", outcome["message"]
        assert outcome["form"] == "compiled"
        assert outcome["measured_peak_bytes"] <= outcome["budget_bytes"] * 1.05
    assert cut["budget_bytes"] < full["budget_bytes"] and cut["measured_peak_bytes"] < full["measured_peak_bytes"]
    assert "peaks measured by plan (the fraction solved at, or a segment candidate): inductor:" in cut["message"]
    assert tiny["status"] == "infeasible" and "raise the budget" in tiny["message"]
    assert not (folder / ".cache" / "memplan" / "graphs").exists() or not any(
        (folder / ".cache" / "memplan" / "graphs").iterdir()), "the compiled form traces nothing"


def test_the_published_compiled_plan_trains_like_eager_pytorch_in_a_plain_loop(project, monkeypatch):
    import memplan

    folder, _ = project
    monkeypatch.syspath_prepend(str(folder))
    sys.modules.pop("mlp", None)
    from mlp import MLP

    from memplan.tasks.config import load_config
    from memplan.tasks.models import build_batch, build_model

    spec = load_config(folder / "pipeline.toml").models[0]
    model = build_model(spec, 0)
    eager = copy.deepcopy(model)
    plan = memplan.runtime.Plan.load(folder / "plans" / "mlp-b512-dtr-compiled-85pct.json")
    assert plan.form == "compiled" and plan.compiled[0].decision.recompute, "the 85% plan recomputes"
    x, y = build_batch(spec, 512, 0, "cpu")

    def loss_fn(m, x, y):
        return F.cross_entropy(m(x), y)

    step = memplan.load(folder / "plans" / "mlp-b512-dtr-compiled-85pct.json", model, loss_fn)
    opt, eager_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(eager.parameters(), lr=0.1)
    for _ in range(3):
        step(x, y)
        opt.step()
        opt.zero_grad()
        loss_fn(eager, x, y).backward()
        eager_opt.step()
        eager_opt.zero_grad()
    assert isinstance(model, MLP)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)
    assert step.compiled.partitioned[0].decision == plan.compiled[0].decision
