"""Caches never serve a result of another model or folder; publishing is all or nothing."""

from __future__ import annotations

import sys

import pytest

from .conftest import tiny_pipeline

NET = """
import torch


def net(**kwargs):
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.{act}())
"""


def test_editing_a_factory_s_source_changes_every_cache_key(tmp_path, monkeypatch):
    """ReLU -> Sigmoid in the factory's file, nothing else changed: the trace is not served from a cache and
    the profile key (the first cached stage, keyed on the traced fingerprint) changes. (The edit changes the
    file's size: Python's bytecode cache, keyed on a source's mtime in seconds and its size, would serve the
    first version of a same-size edit made within the same second.)"""
    from memplan.flows.steps import _profile_key, trace_step
    from memplan.tasks.config import load_config

    monkeypatch.syspath_prepend(str(tmp_path))
    spec = load_config(tiny_pipeline(tmp_path, factory="netmod:net"))
    keys, fingerprints = [], []
    for act in ("ReLU", "Sigmoid"):
        (tmp_path / "netmod.py").write_text(NET.format(act=act))
        sys.modules.pop("netmod", None)                       # a new `memplan run` imports the edited file
        inputs = dict(model=spec.models[0], batch_size=2, device="cpu", seed=0, cache_dir=spec.cache_dir)
        assert trace_step.cache_policy.compute_key(task_ctx=None, inputs=inputs, flow_parameters={}) is None
        traced = trace_step.fn(**inputs)
        fingerprints.append(traced.fingerprint)
        keys.append(_profile_key(None, dict(traced=traced, device="cpu", seed=0, settings=spec.profile,
                                            store=spec.store)))
    assert fingerprints[0] != fingerprints[1] and keys[0] != keys[1]


def test_cached_paths_resolve_from_the_pipeline_file_s_folder(tmp_path, monkeypatch):
    from memplan.tasks.config import load_config

    tiny_pipeline(tmp_path)
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    config = load_config("../pipeline.toml")
    assert (config.store, config.cache_dir, config.publish.dir) == (
        str(tmp_path / "profiles_db"), str(tmp_path / ".cache" / "memplan"), str(tmp_path / "plans"))


def test_a_plan_that_cannot_be_indexed_publishes_nothing(tmp_path):
    from memplan.runtime.format.plan import Plan
    from memplan.runtime.format.plan import plan_id
    from memplan.tasks.publish import PublishError, publish
    from memplan.tasks.records import Validated

    plan = Plan("f" * 64, [{"compute": 0}], predicted={"peak_bytes": 10**30},
                provenance={"solver": "checkmate", "budget_bytes": 10**30})
    validation = Validated(plan_id=plan_id(plan), passed=True, reasons=[], device="cpu", device_name="cpu", budget_bytes=10**30,
                            predicted_peak_bytes=10**30, measured_peak_bytes=1, eager_peak_bytes=2,
                            measured_step_ms=1.0, eager_step_ms=1.0, overhead=0.0, loss=1.0, eager_loss=1.0,
                            max_abs_error=0.0, tensors_compared=1)
    with pytest.raises(PublishError, match="cannot be indexed"):
        publish(plan, validation, tmp_path / "plans", alias="huge", model="mlp", batch_size=2, budget="1e30B")
    assert not (tmp_path / "plans").exists() or not [p for p in (tmp_path / "plans").rglob("*") if p.is_file()]


def test_a_deleted_solutions_folder_is_rebuilt_by_the_next_run(tmp_path, harness):
    """The cached solve result names a plan file under `cache_dir/solutions`; with that folder deleted, the
    next run solves the cell again (instead of failing on a missing file) and publishes the same plan."""
    import shutil

    from typer.testing import CliRunner

    from memplan.flows.cli import app
    from memplan.tasks.publish import read_index

    config = tiny_pipeline(tmp_path)
    runner = CliRunner()
    first = runner.invoke(app, ["run", str(config)])
    assert first.exit_code == 0, first.output
    (row,) = read_index(tmp_path / "plans")
    shutil.rmtree(tmp_path / ".cache" / "memplan" / "solutions")
    second = runner.invoke(app, ["run", str(config)])
    assert second.exit_code == 0, second.output
    assert [r["plan_id"] for r in read_index(tmp_path / "plans")] == [row["plan_id"]]
    assert len(list((tmp_path / ".cache" / "memplan" / "solutions").glob("*.json"))) == 1
