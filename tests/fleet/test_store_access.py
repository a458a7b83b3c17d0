"""A store that cannot be reached stops memplan at once, with a message naming the bucket and the fix: a
missing bucket before any tracing (`memplan profile`, `memplan run`), and `memplan query` and `memplan fleet
status` over it error instead of reporting an empty store. S3 is moto on loopback."""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone

import pytest
from typer.testing import CliRunner

from memplan.flows.cli import app
from memplan.tasks.store.profiles import write_run

from .conftest import free_port

PIPELINE = """
store = "{store}"

[[models]]
name = "mlp"
factory = "tiny_models:mlp"
loss = "cross_entropy"
inputs = [{{ shape = [8] }}, {{ shape = [], dtype = "int64", high = 4 }}]

[[models]]
name = "wide"
factory = "tiny_models:wide"
loss = "cross_entropy"
inputs = [{{ shape = [8] }}, {{ shape = [], dtype = "int64", high = 4 }}]

[[plans]]
solver = "ap-greedy"
budgets = ["90%"]

[deploy]
[[deploy.classes]]
name = "cpu-a"
profile_cron = "0 * * * *"
"""

MODELS = """
from torch import nn

def mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

def wide():
    return nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 4))
"""


def _project(tmp_path, store: str):
    (tmp_path / "tiny_models.py").write_text(MODELS)
    config = tmp_path / "pipeline.toml"
    config.write_text(PIPELINE.format(store=store))
    return config


def _missing(s3_store: str) -> tuple[str, str]:
    bucket = f"{s3_store.split('/')[2]}-typo"
    return bucket, f"s3://{bucket}/profiles"


@pytest.mark.parametrize("command", ["profile", "run"])
def test_a_missing_bucket_fails_before_any_stage_naming_the_bucket(command, s3_store, s3_server, tmp_path):
    import memplan.flows.plan  # noqa: F401  (imported: the time measured is the command's own)
    import memplan.flows.profile  # noqa: F401

    bucket, store = _missing(s3_store)
    config = _project(tmp_path, store)
    start = time.monotonic()
    result = CliRunner().invoke(app, [command, str(config)])
    took = time.monotonic() - start
    assert result.exit_code == 1, result.output
    message = " ".join(result.output.split())
    assert f"there is no bucket '{bucket}' at {s3_server}" in message, message
    assert f"aws s3 mb s3://{bucket} --endpoint-url {s3_server}" in message, message
    assert took < 5, f"`memplan {command}` took {took:.1f} s to refuse a missing bucket"
    assert not (tmp_path / ".cache").exists(), "a stage ran before the store was checked"


def test_query_and_fleet_status_over_a_missing_bucket_error_instead_of_reading_no_rows(s3_store, tmp_path):
    bucket, store = _missing(s3_store)
    config = _project(tmp_path, store)
    runner = CliRunner()
    query = runner.invoke(app, ["query", "--store", store, "--plans", str(tmp_path / "plans"),
                                "SELECT count(*) FROM runs"])
    assert query.exit_code == 1 and f"there is no bucket '{bucket}'" in " ".join(query.output.split()), query.output
    status = runner.invoke(app, ["fleet", "status", str(config)])
    assert status.exit_code == 1 and f"there is no bucket '{bucket}'" in " ".join(status.output.split()), status.output


def test_an_unreachable_endpoint_is_named_within_seconds(tmp_path, monkeypatch):
    for key, value in dict(AWS_ACCESS_KEY_ID="k", AWS_SECRET_ACCESS_KEY="s", AWS_DEFAULT_REGION="us-east-1").items():
        monkeypatch.setenv(key, value)
    endpoint = f"127.0.0.1:{free_port()}"                        # nothing listens there
    store = f"s3://bucket/profiles?endpoint_override={endpoint}&scheme=http"
    start = time.monotonic()
    result = CliRunner().invoke(app, ["query", "--store", store, "--plans", str(tmp_path / "plans"), "SELECT 1"])
    took = time.monotonic() - start
    message = " ".join(result.output.split())
    assert result.exit_code == 1 and f"bucket 'bucket' at http://{endpoint}" in message, message
    assert "cannot be reached" in message and "Check the endpoint" in message, message
    assert took < 5, f"an unreachable endpoint took {took:.1f} s to report"


def test_fleet_status_reports_each_class_and_model_and_exits_1_when_one_is_missing(s3_store, tmp_path, make_run):
    config = _project(tmp_path, s3_store)
    now = datetime.now(timezone.utc)
    rows = make_run("fp-mlp", device="cpu-a", model="mlp")
    write_run([{**r, "created_at": now} for r in rows], s3_store)
    runner = CliRunner()
    status = runner.invoke(app, ["fleet", "status", str(config), "--format", "json"])
    assert status.exit_code == 1, status.output                  # model `wide` was never profiled on cpu-a
    assert [(r["device_class"], r["model"], r["status"]) for r in json.loads(status.stdout)] == [
        ("cpu-a", "mlp", "ok"), ("cpu-a", "wide", "missing")]
    assert runner.invoke(app, ["fleet", "status", str(config), "--no-strict"]).exit_code == 0
