"""The plan and profile flows end to end on a small MLP, under one Prefect test harness."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

TINYNET = '''
import torch
import torch.nn.functional as F
from torch import nn


def mlp(width=32, depth=6):
    """Narrow and deep at a large batch: activations outweigh parameters, so recomputation pays."""
    layers = []
    for i in range(depth):
        layers += [nn.Linear(8 if i == 0 else width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 4))


CALLS = [0]


def drifting_loss(model, x, y):
    """A loss that is not a function of its inputs alone (it scales with a call counter): a plan
    captured at one call cannot reproduce eager steps at another, so validation must reject it."""
    CALLS[0] += 1
    return F.cross_entropy(model(x), y) * CALLS[0]
'''

PIPELINE = '''
device = "cpu"

[[models]]
name = "mlp"
factory = "tinynet:mlp"
kwargs = {{ width = 32, depth = 6 }}
batch_sizes = [256]
inputs = [{{ shape = [8] }}, {{ shape = [], dtype = "int64", high = 4 }}]

{extra_models}

[profile]
warmup = 1
repeats = 2

[[plans]]
solver = "checkmate"
budgets = {checkmate_budgets}
time_limit_s = 60
models = {checkmate_models}

[[plans]]
solver = "chen-sqrt-n"
budgets = ["95%"]
models = ["mlp"]

[validate]
steps = 1
max_steps = 1
warmup = 0
'''

DRIFT_MODEL = '''
[[models]]
name = "drift"
factory = "tinynet:mlp"
kwargs = { width = 32, depth = 6 }
loss = "tinynet:drifting_loss"
batch_sizes = [256]
inputs = [{ shape = [8] }, { shape = [], dtype = "int64", high = 4 }]
'''


def write_project(folder: Path, checkmate_budgets: str = '["90%"]', extra_models: str = "",
                  checkmate_models: str = '["mlp"]') -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tinynet.py").write_text(TINYNET)
    path = folder / "pipeline.toml"
    path.write_text(PIPELINE.format(checkmate_budgets=checkmate_budgets, extra_models=extra_models,
                                    checkmate_models=checkmate_models))
    return path


@pytest.fixture(scope="module")
def project(tmp_path_factory, harness):
    """A pipeline run once: its folder and the outcomes of the first run."""
    from memplan.flows.plan import run_plan

    folder = tmp_path_factory.mktemp("project")
    return folder, run_plan(write_project(folder))


def snapshot(folder: Path) -> dict[str, tuple]:
    return {str(p.relative_to(folder)): (os.lstat(p).st_size, os.lstat(p).st_mtime_ns)
            for p in sorted(folder.rglob("*"))}


def test_every_cell_is_validated_and_published(project):
    from memplan.tasks.publish import read_index

    folder, outcomes = project
    assert [o["alias"] for o in outcomes] == ["mlp-b256-checkmate-90pct", "mlp-b256-chen-sqrt-n-95pct"]
    assert all(o["status"] == "published" for o in outcomes), outcomes
    rows = {r["alias"]: r for r in read_index(folder / "plans")}
    assert set(rows) == {o["alias"] for o in outcomes}
    for o in outcomes:
        row = rows[o["alias"]]
        assert row["plan_id"] == o["plan_id"] and row["device"] == "cpu"
        assert row["budget_bytes"] == int(float(o["budget"].removesuffix("pct")) / 100 * o["checkpoint_all_peak_bytes"])
        assert row["predicted_peak_bytes"] <= row["budget_bytes"]
        assert row["measured_peak_bytes"] <= 1.05 * row["budget_bytes"]
        assert (folder / "plans" / f"{o['alias']}.json").resolve() == (folder / "plans" / f"{o['plan_id']}.json")


def test_a_published_plan_trains_like_eager_pytorch(project):
    """The README's snippet: load a published plan and train three SGD steps."""
    from memplan import runtime
    from memplan.tasks.config import load_config
    from memplan.tasks.models import build_batch, build_loss, build_model

    folder, _ = project
    spec = load_config(folder / "pipeline.toml", solvers=["checkmate", "chen-sqrt-n"]).models[0]
    batch, loss_fn = build_batch(spec, 256, seed=1), build_loss(spec)
    planned, eager = build_model(spec, seed=1), build_model(spec, seed=1)
    step = runtime.load(folder / "plans" / "mlp-b256-checkmate-90pct.json", planned, loss_fn)
    opt_plan = torch.optim.SGD(planned.parameters(), lr=0.1)
    opt_eager = torch.optim.SGD(eager.parameters(), lr=0.1)
    for _ in range(3):
        opt_plan.zero_grad()
        loss = step(*batch)
        opt_plan.step()
        opt_eager.zero_grad()
        expected = loss_fn(eager, *batch)
        expected.backward()
        opt_eager.step()
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for p, q in zip(planned.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_second_run_reuses_every_stage_and_changes_nothing(project):
    from memplan.flows.plan import run_plan

    folder, outcomes = project
    watched = [folder / "plans", folder / "profiles_db", folder / ".cache" / "memplan" / "graphs",
               folder / ".cache" / "memplan" / "solutions"]
    before = [snapshot(f) for f in watched]
    assert run_plan(folder / "pipeline.toml") == outcomes
    assert [snapshot(f) for f in watched] == before
    assert len(list((folder / "profiles_db").rglob("*.parquet"))) == 1


def test_prefect_results_are_json_records(project):
    folder, _ = project
    results = list((folder / ".cache" / "memplan" / "prefect").iterdir())
    kinds = {p.name.split("-")[0] for p in results}
    assert {"profile", "solve", "validate"} <= kinds       # the trace runs every time (its fingerprint keys these)
    for path in results:
        record = json.loads(path.read_text())
        assert record["metadata"]["serializer"]["type"] == "json"


def test_run_leaves_a_plans_table_and_a_plot(project):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    folder, _ = project
    png = folder / ".cache" / "memplan" / "reports" / "mlp-memory-vs-overhead.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with get_client(sync_client=True) as client:
        newest = dict(sort=ArtifactSort.CREATED_DESC)      # other modules' runs share the session's server
        tables = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["memplan-plans"])),
                                       **newest)
        plots = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["memplan-mlp-plot"])),
                                      **newest)
    assert "| mlp-b256-checkmate-90pct | checkmate | executor | 90pct |" in tables[0].data
    assert "To train with them: executor plans, memplan.load(plan, model, loss_fn)." in tables[0].data
    assert plots[0].data.startswith("data:image/png;base64,")


def test_failures_are_explained_and_only_valid_plans_are_published(tmp_path, harness):
    from memplan.flows.plan import PipelineFailed, run_plan
    from memplan.tasks.publish import read_index

    config = write_project(tmp_path, checkmate_budgets='["90%", 1000]', extra_models=DRIFT_MODEL,
                           checkmate_models='["mlp", "drift"]')
    with pytest.raises(PipelineFailed) as failed:
        run_plan(config)
    status = {o["alias"]: o["status"] for o in failed.value.outcomes}
    assert status == {"mlp-b256-checkmate-90pct": "published", "mlp-b256-checkmate-1000B": "infeasible",
                      "mlp-b256-chen-sqrt-n-95pct": "published", "drift-b256-checkmate-90pct": "rejected",
                      "drift-b256-checkmate-1000B": "infeasible"}
    message = str(failed.value)
    assert message.startswith("3 of 5 plans were not published (2 were): ")
    assert "mlp-b256-checkmate-1000B: solver checkmate found no schedule within 1,000 B" in message
    floors = [int(f.replace(",", "")) for f in re.findall(r"the least feasible budget this run knows is ([\d,]+) B", message)]
    published = [o["predicted_peak_bytes"] for o in failed.value.outcomes if o["alias"].startswith("mlp")
                 and o["status"] == "published"]
    assert floors and floors[0] <= min(published)              # never above a schedule the run itself found
    assert "plan drift-b256-checkmate-90pct failed validation on cpu: loss differs from eager" in message
    assert {r["alias"] for r in read_index(tmp_path / "plans")} == {"mlp-b256-checkmate-90pct", "mlp-b256-chen-sqrt-n-95pct"}
    assert not list(tmp_path.glob("plans/drift*")) and not list((tmp_path / "plans").rglob(".*"))
    assert not list((tmp_path / "profiles_db").rglob(".*"))
    for record in (tmp_path / ".cache" / "memplan" / "prefect").iterdir():   # the failed flow's exception too
        json.loads(record.read_text())                                    # JSON, never a base64 pickle


def test_profile_flow_measures_a_new_run_each_time(project):
    from memplan.flows.profile import run_profile

    folder, _ = project
    before = len(list((folder / "profiles_db").rglob("*.parquet")))
    runs = run_profile(folder / "pipeline.toml")
    assert [(r["model"], r["batch_size"]) for r in runs] == [("mlp", 256)]
    assert len(list((folder / "profiles_db").rglob("*.parquet"))) == before + 1
    assert run_profile(folder / "pipeline.toml", reuse=True) == runs
