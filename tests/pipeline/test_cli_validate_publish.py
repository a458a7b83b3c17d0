"""`memplan validate PLAN` and `memplan publish PLAN` from the command line on a tiny project (a 3-layer
MLP and its eager-order plan): a passing plan, one over its budget, a tampered file, publishing once."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memplan.flows.cli import app

runner = CliRunner(env={"COLUMNS": "200"})

TINYNET = '''
from torch import nn


def mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
'''
DRIFTING_LOSS = Path(__file__).with_name("drift.py")

PIPELINE = '''
device = "cpu"

[[models]]
name = "tiny"
factory = "clinet:mlp"
batch_sizes = [32]
inputs = [{ shape = [8] }, { shape = [], dtype = "int64", high = 4 }]

[profile]
warmup = 0
repeats = 1

[[plans]]
solver = "checkpoint-all"
budgets = [1.0]

[validate]
steps = 1
max_steps = 1
warmup = 0
'''

DRIFT = '''
[[models]]
name = "drift"
factory = "clinet:mlp"
loss = "drift:drifting_loss"
batch_sizes = [32]
inputs = [{ shape = [8] }, { shape = [], dtype = "int64", high = 4 }]
'''


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A project folder and, as `memplan run` would publish it, the eager-order plan of its model."""
    from memplan import runtime
    from memplan.runtime.format.plan import default_plan
    from memplan.tasks.config import load_config
    from memplan.tasks.models import allow_imports_from, build_batch, build_loss, build_model

    folder = tmp_path_factory.mktemp("cli")
    (folder / "clinet.py").write_text(TINYNET)
    shutil.copy(DRIFTING_LOSS, folder / "drift.py")
    (folder / "pipeline.toml").write_text(PIPELINE)
    allow_imports_from(folder)
    spec = load_config(folder / "pipeline.toml").models[0]
    graph = runtime.capture(build_model(spec, 0), build_loss(spec), build_batch(spec, 32, 0, "cpu"))
    plan = default_plan(graph)
    plan.provenance.update(solver="checkpoint-all", budget_bytes=10**9)
    plan.predicted["peak_bytes"] = 10**4
    (folder / "plans").mkdir()
    plan.save(plan_file(folder))
    return folder, None


def plan_file(folder: Path) -> Path:
    return folder / "plans" / "tiny-b32-checkpoint-all-100pct.json"


def test_validate_passes_a_published_plan(project):
    folder, _ = project
    result = runner.invoke(app, ["validate", str(plan_file(folder)), "--config", str(folder / "pipeline.toml")])
    assert result.exit_code == 0, result.output
    assert "validation on cpu" in result.output and "passed" in result.output


def over_budget_copy(folder: Path) -> Path:
    """The published plan re-saved (valid checksum) with a budget of 1 byte."""
    from memplan.runtime.format.plan import Plan

    plan = Plan.load(plan_file(folder))
    plan.provenance["budget_bytes"] = 1
    path = folder / "over-budget.json"
    plan.save(path)
    return path


def test_validate_and_publish_refuse_a_plan_over_its_budget(project):
    from memplan.tasks.publish import read_index

    folder, _ = project
    path = over_budget_copy(folder)
    before = read_index(folder / "plans")
    for command in ("validate", "publish"):
        result = runner.invoke(app, [command, str(path), "--config", str(folder / "pipeline.toml")])
        assert result.exit_code == 1, (command, result.output)
        text = " ".join(result.output.split())
        assert "failed validation on cpu: measured peak" in text, result.output
        assert "exceeds the budget 1 B" in text and "Traceback" not in text
    assert read_index(folder / "plans") == before


def test_publish_validates_then_publishes_once(project):
    from memplan.runtime.format.plan import Plan
    from memplan.tasks.publish import plan_id, read_index

    folder, _ = project
    plan = Plan.load(plan_file(folder))
    plan.provenance["note"] = "copy"
    path = folder / "copy.json"
    plan.save(path)
    args = ["publish", str(path), "--config", str(folder / "pipeline.toml"), "--alias", "tiny-copy"]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    assert "passed" in first.output and f"{plan_id(plan)}.json" in " ".join(first.output.split())
    assert json.loads((folder / "plans" / "tiny-copy.json").read_text())["provenance"]["note"] == "copy"
    assert "tiny-copy" in {r["alias"] for r in read_index(folder / "plans")}
    again = runner.invoke(app, args)
    assert again.exit_code == 0 and "already published, nothing changed" in again.output


def test_a_tampered_plan_file_is_refused_by_validate(project):
    folder, _ = project
    data = json.loads(plan_file(folder).read_text())
    data["provenance"]["budget_bytes"] = 10**12
    (folder / "tampered.json").write_text(json.dumps(data))
    result = runner.invoke(app, ["validate", str(folder / "tampered.json"), "--config", str(folder / "pipeline.toml")])
    assert result.exit_code == 1 and "edited or corrupted" in result.output and "Traceback" not in result.output


def max_overhead_copy(folder: Path, name: str, limit: float, sibling: bool) -> Path:
    """The published plan as a `max_overhead` cell's plan `name` (limit `limit`), with the cell's
    no-recomputation plan beside it as the solve stage writes it when `sibling`."""
    from memplan.runtime.format.plan import Plan

    plan = Plan.load(plan_file(folder))
    if sibling:
        plan.provenance["solver"] = "checkpoint-all"
        plan.save(folder / f"{name}-no-recompute.json")
    plan.provenance.update(solver="dtr", max_overhead=limit)
    plan.save(folder / f"{name}.json")
    return folder / f"{name}.json"


def test_validate_and_publish_measure_a_max_overhead_plan_against_its_no_recompute_plan(project):
    from memplan.tasks.publish import read_index

    folder, _ = project
    path = max_overhead_copy(folder, "cell", 10.0, sibling=True)        # the same schedule: +1000% is never reached
    config = str(folder / "pipeline.toml")
    result = runner.invoke(app, ["validate", str(path), "--config", config])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "vs no recompute" in text and "(against cell-no-recompute.json)" in text, result.output
    assert "max_overhead │ +1000% │ within the limit" in text, result.output
    published = runner.invoke(app, ["publish", str(path), "--config", config, "--alias", "tiny-cell"])
    assert published.exit_code == 0, published.output
    row = next(r for r in read_index(folder / "plans") if r["alias"] == "tiny-cell")
    assert row["max_overhead"] == 10.0 and row["overhead_vs_no_recompute"] is not None


def test_without_its_no_recompute_plan_validate_builds_the_eager_order_plan_of_its_graph(project):
    folder, _ = project
    path = max_overhead_copy(folder, "lonely", 10.0, sibling=False)
    result = runner.invoke(app, ["validate", str(path), "--config", str(folder / "pipeline.toml")])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "vs no recompute" in text and "against the eager-order plan of its graph, built here" in text, result.output
    assert "there is no no-recomputation plan beside it" in text and "within the limit" in text


def test_a_plan_whose_no_recompute_step_is_not_built_here_is_not_judged(project, make_validation):
    from rich.console import Console

    from memplan.flows.commands.validate import CommandValidation, no_recompute_for, validation_table
    from memplan.runtime.format.plan import Plan
    from memplan.tasks.config import load_config

    folder, _ = project
    plan = Plan.load(max_overhead_copy(folder, "in-step", 0.1, sibling=False))
    plan.provenance["optimizer_in_step"] = "adamw"
    spec = load_config(folder / "pipeline.toml").models[0]
    graph, baseline, why = no_recompute_for(folder / "in-step.json", plan, spec, 32, "cpu", 0)
    assert graph is None and baseline is None
    assert "only the overhead against eager is measured" in why and "optimizer inside the step" in why
    done = CommandValidation(make_validation(plan), spec, 32, 0.1, why, judged=False)
    console = Console(width=300, record=True)
    console.print(validation_table(done))
    text = " ".join(console.export_text().split())
    assert "max_overhead │ +10% │ not judged: there is no no-recomputation plan beside it" in text
    assert "vs no recompute" not in text
