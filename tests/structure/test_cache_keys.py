"""Cache keys hash what a stage runs (flows/codehash.py): editing any file in a cached stage's import
closure (the files the old hand-kept list left out included) changes that stage's key, so no stale result
is served; editing a file outside it (a CLI command) does not."""

from __future__ import annotations

import shutil

import pytest

from memplan.flows import codehash
from memplan.flows.codehash import PACKAGES, ROOT, STAGE_MODULES, code_hash, import_closure

DEPENDENCIES = {
    "profile": ["tasks/profile/stage.py", "tasks/store/profiles.py", "tasks/config/schema.py", "runtime/tracing/capture.py", "runtime/execute/arena.py"],
    "solve": ["tasks/solve_stage.py", "tasks/solve/core/simulator.py", "tasks/solve/olla/location.py",
              "tasks/problems.py", "tasks/store/profiles.py", "tasks/config/schema.py", "runtime/format/plan.py", "runtime/variants/offered.py"],
    "reference": ["tasks/validate/reference.py", "tasks/models.py", "tasks/records.py", "runtime/measure/exact.py", "runtime/measure/meter.py"],
    "validate": ["tasks/validate/stage.py", "tasks/validate/reference.py", "tasks/models.py", "tasks/config/schema.py", "runtime/execute/executor.py",
                 "runtime/execute/arena.py", "runtime/tracing/capture.py", "runtime/execute/cuda_graph.py"],
    "compiled_search": ["tasks/compiled/policy_cell.py", "tasks/compiled/policy_search.py", "tasks/solve_stage.py",
                        "tasks/solve/policy_solver.py", "runtime/policy/compiled_peak.py", "runtime/policy/apply.py", "tasks/models.py"],
    "compiled_plans": ["tasks/compiled/plans.py", "tasks/compiled/form.py", "runtime/compiled/step.py",
                       "runtime/compiled/partition.py", "runtime/compiled/joint.py", "tasks/models.py"],
}


@pytest.fixture
def tree(tmp_path):
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


@pytest.mark.parametrize("stage", sorted(STAGE_MODULES))
def test_an_edit_to_each_dependency_misses_the_cache(tree, stage):
    closure = {str(p.relative_to(tree)) for p in import_closure(STAGE_MODULES[stage], tree)}
    before = code_hash(stage, tree)
    for rel in DEPENDENCIES[stage]:
        assert rel in closure, f"{stage} runs {rel} but its key does not hash it"
        original = (tree / rel).read_text()
        (tree / rel).write_text(original + "\n# an edit\n")
        assert code_hash(stage, tree) != before, f"editing {rel} left the {stage} key unchanged"
        (tree / rel).write_text(original)
        assert code_hash(stage, tree) == before


def test_an_edit_outside_the_closure_keeps_the_key(tree):
    before = {stage: code_hash(stage, tree) for stage in STAGE_MODULES}
    (tree / "flows/commands/query.py").write_text((tree / "flows/commands/query.py").read_text() + "\n# an edit\n")
    assert {stage: code_hash(stage, tree) for stage in STAGE_MODULES} == before


def test_the_solve_key_carries_the_code_hash(monkeypatch):
    from memplan.flows.steps import _solve_key
    from memplan.tasks.config import PlanSettings
    from memplan.tasks.records import Profiled, Traced

    traced = Traced(path="g.json", fingerprint="f", model="m", batch_size=1, nodes=1, values=1, constant_bytes=0)
    profile = Profiled(run_id="r", device="cpu", fingerprint="f", rows=1, path="p.parquet")
    cell = dict(traced=traced, profile=profile, solver="dtr", budget=None, settings=PlanSettings(), device="cpu")
    key = _solve_key(None, cell)
    monkeypatch.setattr("memplan.flows.steps.code_hash", lambda stage: "edited")
    assert _solve_key(None, cell) != key
    assert codehash.ROOT == ROOT
