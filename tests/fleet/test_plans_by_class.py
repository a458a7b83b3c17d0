"""The plans index records the fleet device class of the host that validated each plan, so that a training
job picks the newest plan of its class even where classes share a GPU name (MIG slices)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from memplan.flows.cli import app
from memplan.runtime.format.plan import Plan, plan_id
from memplan.tasks.publish import DEVICE_CLASS_VAR, publish
from memplan.tasks.records import Validated

VALIDATION = dict(passed=True, reasons=[], device="cuda", device_name="NVIDIA A100-SXM4-80GB MIG 1g.10gb",
                  budget_bytes=200, predicted_peak_bytes=196, measured_peak_bytes=190, eager_peak_bytes=260,
                  measured_step_ms=2.0, eager_step_ms=1.6, overhead=0.25, loss=1.0, eager_loss=1.0,
                  max_abs_error=0.0, tensors_compared=2)


def _publish(plans, monkeypatch, device_class: str, budget: int) -> str:
    monkeypatch.setenv(DEVICE_CLASS_VAR, device_class)
    plan = Plan("f" * 64, [{"compute": 0}], predicted={"peak_bytes": budget - 4},
                provenance={"solver": "checkmate", "budget_bytes": budget})
    return publish(plan, Validated(plan_id=plan_id(plan), **VALIDATION), plans, alias=f"mlp-{device_class}-{budget}", model="mlp",
                   batch_size=4, budget=f"{budget}B").plan_id


def test_plans_list_and_query_select_the_newest_plan_of_a_class(tmp_path, monkeypatch):
    plans = tmp_path / "plans"
    older = _publish(plans, monkeypatch, "a100-1g", 200)
    other = _publish(plans, monkeypatch, "a100-3g", 300)           # same GPU name, another class
    newest = _publish(plans, monkeypatch, "a100-1g", 400)
    (tmp_path / "store").mkdir()
    runner = CliRunner()
    listed = runner.invoke(app, ["plans", "list", "--dir", str(plans), "--class", "a100-1g", "--model", "mlp",
                                 "--limit", "1"], terminal_width=250)
    assert listed.exit_code == 0, listed.output
    assert newest[:12] in listed.output and older[:12] not in listed.output and other[:12] not in listed.output
    both = runner.invoke(app, ["plans", "list", "--dir", str(plans), "--class", "a100-1g"], terminal_width=250)
    assert older[:12] in both.output and other[:12] not in both.output, both.output
    query = runner.invoke(app, ["query", "--plans", str(plans), "--store", str(tmp_path / "store"), "--format",
                                "json", "SELECT plan_id, device_class FROM plans WHERE device_class = 'a100-1g' "
                                "AND model = 'mlp' AND batch_size = 4 ORDER BY published_at DESC LIMIT 1"])
    assert query.exit_code == 0, query.output
    assert json.loads(query.stdout) == [{"plan_id": newest, "device_class": "a100-1g"}]
