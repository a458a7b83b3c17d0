"""The set-up of docs/fleet.md, end to end on loopback: PostgreSQL (initdb/pg_ctl in a temporary folder)
under `prefect server start`, `memplan deploy` (a process work pool, a queue per device class, cron
schedules), two workers on different queues with different device keys (two "hosts"), triggered runs of
the profile flow on both queues; both hosts' profiles land in one store, `memplan query` groups them by
device and `memplan fleet status` lists both classes. Every process started here is stopped in the
fixtures' teardown; every wait is bounded.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from contextlib import ExitStack
from pathlib import Path

import pytest
from typer.testing import CliRunner

from .conftest import REPO, prefect_server_on, started, wait_until

CLASSES = ("cpu-a", "cpu-b")
QUIET_SERVICES = ("CANCELLATION_CLEANUP", "DB_VACUUM", "EVENT_LOGGER", "FOREMAN", "LATE_RUNS", "SCHEDULER",
                  "PAUSE_EXPIRATIONS", "REPOSSESSOR", "CLEANUP_RECONCILER", "TRIGGERS")


@pytest.fixture(scope="module")
def prefect_server(postgres, tmp_path_factory):
    """`prefect server start` on 127.0.0.1 backed by `postgres`, QUIET_SERVICES off; yields its API URL."""
    with prefect_server_on(postgres, tmp_path_factory.mktemp("prefect-server"),
                           {f"PREFECT_SERVER_SERVICES_{name}_ENABLED": "false" for name in QUIET_SERVICES}) as api:
        yield api


PIPELINE = """
store = "{store}"
cache_dir = "{cache}"

[[models]]
name = "mlp"
factory = "tiny_models:mlp"
loss = "cross_entropy"
batch_sizes = [4]
inputs = [{{ shape = [8] }}, {{ shape = [], dtype = "int64", high = 4 }}]

[profile]
warmup = 0
repeats = 1
retries = 0

[[plans]]
solver = "ap-greedy"
budgets = ["90%"]

[deploy]
work_pool = "gpu-fleet"

[[deploy.classes]]
name = "cpu-a"
profile_cron = "0 * * * *"

[[deploy.classes]]
name = "cpu-b"
profile_cron = "30 2 * * *"
plan_cron = "0 4 * * *"
profile_parameters = {{ reuse = false }}
"""

MODELS = '''
from torch import nn

def mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
'''


@pytest.fixture
def project(tmp_path):
    """A project folder shared by both hosts (as on an NFS mount): pipeline.toml, its model module, a store."""
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "tiny_models.py").write_text(textwrap.dedent(MODELS))
    (folder / "pipeline.toml").write_text(PIPELINE.format(store=tmp_path / "store", cache=tmp_path / "cache"))
    return folder


def _deploy(config: Path, api: str) -> dict[str, str]:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from memplan.flows.commands.deploy import deploy
    from memplan.tasks.config import load_config

    with temporary_settings({PREFECT_API_URL: api}):
        return dict(deploy(config, load_config(config).deploy))


@pytest.mark.fleet_e2e
def test_two_hosts_profile_on_schedule_into_one_store(prefect_server, project, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from memplan.flows.cli import app

    api, config = prefect_server, project / "pipeline.toml"
    first = _deploy(config, api)
    assert first == {"work pool gpu-fleet": "created", "work queue cpu-a": "created", "work queue cpu-b": "created",
                     **{f"deployment {f}/{c}@gpu-fleet": "created" for c in CLASSES for f in ("profile", "plan", "fit")},
                     "automation memplan gpu-fleet: zombie runs": "created"}
    assert set(_deploy(config, api).values()) == {"unchanged"}          # idempotent

    with ExitStack() as workers:
        for cls in CLASSES:                                               # one worker per "host"
            env = {**os.environ, "PREFECT_API_URL": api, "PREFECT_HOME": str(tmp_path / f"home-{cls}"),
                   "MEMPLAN_DEVICE_KEY": cls, "PYTHONPATH": str(REPO), "PREFECT_WORKER_QUERY_SECONDS": "1",
                   "PREFECT_LOGGING_LEVEL": "WARNING", "OMP_NUM_THREADS": "1"}
            workers.enter_context(started([str(Path(sys.executable).with_name("prefect")), "worker", "start",
                                           "--pool", "gpu-fleet", "--work-queue", cls, "--type", "process",
                                           "--limit", "1"], tmp_path / f"worker-{cls}.log", env=env, cwd=project))
        with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as client:
            deployments = {c: client.read_deployment_by_name(f"profile/{c}@gpu-fleet") for c in CLASSES}
            assert [s.schedule.cron for s in deployments["cpu-a"].schedules] == ["0 * * * *"]
            assert client.read_deployment_by_name("plan/cpu-b@gpu-fleet").schedules[0].schedule.cron == "0 4 * * *"
            assert client.read_deployment_by_name("plan/cpu-a@gpu-fleet").schedules == []
            runs = {c: client.create_flow_run_from_deployment(d.id) for c, d in deployments.items()}

            def finished() -> bool:
                states = {c: client.read_flow_run(r.id).state for c, r in runs.items()}
                failed = {c: s.message for c, s in states.items() if s.is_final() and not s.is_completed()}
                assert not failed, (failed, _logs(tmp_path))
                return all(s.is_completed() for s in states.values())

            wait_until(finished, 240, "both profile runs completing", interval=1)
            assert {c: client.read_flow_run(r.id).work_queue_name for c, r in runs.items()} == {c: c for c in CLASSES}

    runner = CliRunner()
    grouped = runner.invoke(app, ["query", "--store", str(tmp_path / "store"), "--plans", str(tmp_path / "plans"),
                                  "--format", "json", "SELECT device, count(*) AS runs, bool_and(complete) AS "
                                  "complete FROM runs GROUP BY device ORDER BY device"])
    assert grouped.exit_code == 0, grouped.output
    assert json.loads(grouped.stdout) == [{"device": c, "runs": 1, "complete": True} for c in CLASSES]
    status = runner.invoke(app, ["fleet", "status", str(config), "--format", "json", "--strict"])
    assert status.exit_code == 0, status.output
    rows = json.loads(status.stdout)
    assert [(r["device_class"], r["status"], r["model"]) for r in rows] == [(c, "ok", "mlp") for c in CLASSES]
    assert rows[0]["allowed_age_s"] == 3600 and rows[1]["allowed_age_s"] == 86400


def _logs(folder: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in folder.glob("worker-*.log"))
