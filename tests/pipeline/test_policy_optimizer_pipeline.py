"""A policy-form plan with the optimizer inside the step from `memplan run`: a `selective-policy` plan with
`optimizer_in_step = true` (the pipeline's `optimizer = "adamw"`) is solved on the eager graph with the
updates' memory, validated by `runtime.apply(..., optimizer=opt)` against eager `loss.backward(); opt.step()`
(parameters after the update, measured peak within the prediction's tolerance) and published recording both its
form and its optimizer; the published plan then trains in a plain loop to eager's parameters."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch.nn.functional as F

from tests.pipeline.test_policy_pipeline import run_blocknet

PLANS = '''
[[plans]]
solver = "selective-policy"
budgets = [0.8]
optimizer_in_step = true
'''

ALIAS = "blocknet-b128-selective-policy-in-step-80pct"


@pytest.fixture(scope="module")
def project(tmp_path_factory, harness):
    """The pipeline run once on BlockNet: its folder and outcomes."""
    return run_blocknet(tmp_path_factory, "policy-optimizer-project", PLANS, top='optimizer = "adamw"')


def test_the_plan_is_solved_with_the_updates_validated_and_published(project):
    from memplan.runtime.format.plan import Plan
    from memplan.tasks.publish import read_index

    folder, outcomes = project
    assert {o["alias"]: (o["form"], o["status"]) for o in outcomes} == {ALIAS: ("policy", "published")}
    plan = Plan.load(folder / "plans" / f"{ALIAS}.json")
    assert (plan.provenance["form"], plan.provenance["capture"], plan.provenance["optimizer_in_step"]) == (
        "policy", "eager", "adamw")
    assert len(plan.compute_steps()) > len(set(plan.compute_steps()))           # it recomputes something
    model = built_model(folder)
    assert plan.predicted["optimizer_state_bytes"] == 2 * sum(p.numel() * 4 for p in model.parameters())
    row, = read_index(folder / "plans")
    assert row["form"] == "policy"
    assert row["predicted_peak_bytes"] <= row["budget_bytes"] < row["eager_peak_bytes"]
    # validation's meter counts the allocator's bytes: kernels' scratch (about 5 KiB here) on top of the tensors;
    # far below the prediction, the plan would not be planning the memory its updates free
    ratio = row["measured_peak_bytes"] / row["predicted_peak_bytes"]
    assert 0.99 <= ratio <= 1.05, row                         # [validate] peak_rtol


def test_the_published_plan_updates_like_eager_adamw_in_a_plain_loop(project):
    """Three steps of loss.backward() under runtime.apply(..., optimizer=opt), no optimizer.step(): eager's
    parameters and AdamW state, bit for bit (one shared dropout draw per step)."""
    from memplan import runtime
    from memplan.tasks.config import load_config
    from memplan.tasks.models import build_batch

    folder, _ = project
    model = built_model(folder)
    spec = load_config(folder / "pipeline.toml").models[0]
    batch = build_batch(spec, 128, seed=0, device="cpu")
    eager, planned = copy.deepcopy(model), copy.deepcopy(model)
    eager_opt, planned_opt = (torch.optim.AdamW(m.parameters(), lr=0.01) for m in (eager, planned))
    runtime.apply(folder / "plans" / f"{ALIAS}.json", planned, loss_fn, batch, optimizer=planned_opt)
    for seed in range(3):
        torch.manual_seed(seed)
        loss_fn(eager, *batch).backward()
        eager_opt.step()
        eager_opt.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        loss_fn(planned, *batch).backward()
        assert all(p.grad is None for p in planned.parameters())
    for (name, want), got in zip(eager.named_parameters(), planned.parameters()):
        assert torch.equal(got, want), name
    want, got = eager_opt.state_dict()["state"], planned_opt.state_dict()["state"]
    assert want.keys() == got.keys()
    for k in want:
        for key in want[k]:
            assert torch.equal(got[k][key], want[k][key]), (k, key)


def test_plans_show_says_to_pass_the_optimizer(project):
    from typer.testing import CliRunner

    from memplan.flows.cli import app

    folder, _ = project
    shown = CliRunner(env={"COLUMNS": "250"}).invoke(app, ["plans", "show", ALIAS, "--dir", str(folder / "plans")])
    assert shown.exit_code == 0, shown.output
    assert "memplan.apply(plan, model, loss_fn, batch, optimizer=opt), opt a torch.optim.AdamW over " \
           "model.parameters()" in shown.output


def loss_fn(model, x, y):
    return F.cross_entropy(model(x), y)


def built_model(folder):
    from memplan.tasks.config import load_config
    from memplan.tasks.models import build_model

    sys.path.insert(0, str(folder))
    try:
        return build_model(load_config(folder / "pipeline.toml").models[0], seed=0)
    finally:
        sys.path.remove(str(folder))
