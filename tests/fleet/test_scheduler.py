"""Scheduled profiling as a fleet runs it: Prefect's own scheduler service (on, at its default settings)
creates the cron runs of `memplan deploy`'s deployments and a worker runs them; no run is created through
the API. Plus a fast guard that the installed SQLAlchemy lets the scheduler insert runs at all (SQLAlchemy
2.1 makes every scheduler loop fail with `Can't evaluate bulk DML statement`: constraints.txt pins 2.0).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from .conftest import REPO, prefect_server_on, started, wait_until

SCHEDULE_ONCE = textwrap.dedent('''
    import asyncio

    from prefect.server import models, schemas
    from prefect.server.database import provide_database_interface
    from prefect.server.services.scheduler import schedule_deployments


    async def main() -> None:
        db = provide_database_interface()
        await db.create_db()
        async with db.session_context(begin_transaction=True) as session:
            flow = await models.flows.create_flow(session, schemas.core.Flow(name="profile"))
            await models.deployments.create_deployment(session, schemas.core.Deployment(
                name="guard", flow_id=flow.id, schedules=[schemas.core.DeploymentSchedule(
                    schedule=schemas.schedules.CronSchedule(cron="* * * * *"), active=True)]))
        await schedule_deployments()
        async with db.session_context() as session:
            runs = await models.flow_runs.read_flow_runs(session)
        print(sum(r.auto_scheduled for r in runs))

    asyncio.run(main())
''')


def test_installed_sqlalchemy_lets_the_scheduler_insert_runs(tmp_path):
    """One pass of the scheduler service (`schedule_deployments`) on a SQLite database schedules runs."""
    import sqlalchemy

    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "home"),
           "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{tmp_path / 'prefect.db'}"}
    done = subprocess.run([sys.executable, "-c", SCHEDULE_ONCE], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and int(done.stdout.split()[-1]) > 0, (
        f"Prefect's scheduler service cannot insert scheduled runs with SQLAlchemy {sqlalchemy.__version__}: "
        f"no cron deployment would ever run. Install the versions of constraints.txt (SQLAlchemy 2.0.x; 2.1 "
        f"fails with `Can't evaluate bulk DML statement`).\n{done.stderr[-3000:]}")


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
work_pool = "scheduled-fleet"

[[deploy.classes]]
name = "cpu-cron"
profile_cron = "* * * * *"
"""

MODELS = '''
from torch import nn

def mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
'''


@pytest.fixture
def scheduling_server(postgres, tmp_path):
    """`prefect server start` on `postgres` with every service at its default (the scheduler on)."""
    home = tmp_path / "server-home"
    home.mkdir()
    with prefect_server_on(postgres, home) as api:
        yield api


@pytest.mark.fleet_e2e
def test_scheduler_creates_and_a_worker_completes_a_cron_profile_run(scheduling_server, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from memplan.flows.cli import app
    from memplan.flows.commands.deploy import deploy
    from memplan.tasks.config import load_config

    api, project = scheduling_server, tmp_path / "project"
    project.mkdir()
    (project / "tiny_models.py").write_text(textwrap.dedent(MODELS))
    config = project / "pipeline.toml"
    config.write_text(PIPELINE.format(store=tmp_path / "store", cache=tmp_path / "cache"))
    env = {**os.environ, "PREFECT_API_URL": api, "PREFECT_HOME": str(tmp_path / "worker-home"),
           "MEMPLAN_DEVICE_KEY": "cpu-cron", "PYTHONPATH": str(REPO), "PREFECT_WORKER_QUERY_SECONDS": "1",
           "PREFECT_LOGGING_LEVEL": "WARNING", "OMP_NUM_THREADS": "1"}
    with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as client:
        assert dict(deploy(config, load_config(config).deploy))["deployment profile/cpu-cron@scheduled-fleet"] == "created"
        deployment = client.read_deployment_by_name("profile/cpu-cron@scheduled-fleet")
        of_deployment = DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id]))
        with started([str(Path(sys.executable).with_name("prefect")), "worker", "start", "--pool", "scheduled-fleet",
                      "--work-queue", "cpu-cron", "--type", "process", "--limit", "1"], tmp_path / "worker.log",
                     env=env, cwd=project):

            def completed() -> list:
                runs = client.read_flow_runs(deployment_filter=of_deployment)
                failed = [(r.name, r.state.message) for r in runs if r.state.is_final() and not r.state.is_completed()]
                assert not failed, (failed, (tmp_path / "worker.log").read_text()[-3000:])
                return [r for r in runs if r.state.is_completed()]

            wait_until(completed, 170, "a scheduled profile run completing (the scheduler creates the every-minute "
                       "runs, the worker starts each when due)", interval=2)
            run = completed()[0]
        runs = client.read_flow_runs(deployment_filter=of_deployment)
        assert runs and all(r.auto_scheduled and r.idempotency_key.startswith("scheduled ") for r in runs)
        assert run.expected_start_time.second == 0 and run.work_queue_name == "cpu-cron"
        history = [s.type.value for s in client.read_flow_run_states(run.id)]
        assert history[0] == "SCHEDULED" and history[-1] == "COMPLETED", history
    grouped = CliRunner().invoke(app, ["query", "--store", str(tmp_path / "store"), "--plans", str(tmp_path / "plans"),
                                       "--format", "json", "SELECT device, model, bool_and(complete) AS complete "
                                       "FROM runs GROUP BY ALL"])
    assert grouped.exit_code == 0, grouped.output
    assert json.loads(grouped.stdout) == [{"device": "cpu-cron", "model": "mlp", "complete": True}]
