"""What operators meet on a running fleet, on loopback with every Prefect server service at its default:
`memplan deploy --dry-run` changes nothing, pausing stops a class's schedules and cancels its scheduled
and late runs (resuming says which were paused); a host runs one profile at a
time (`--limit 1`); a host killed mid-run (worker and flow process, SIGKILL) leaves a run that the zombie
automation marks crashed (no heartbeat) and runs again on the surviving host, with nothing partial in the
store; a worker killed alone takes its flow process along, and that run too is crashed and re-run. Every
process started here is stopped in teardown; every wait is bounded.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
import textwrap
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from typer.testing import CliRunner

from .conftest import REPO, prefect_server_on, started, stop, wait_until

CLASS = "cpu-q"
HEARTBEAT_S, ZOMBIE_AFTER_S = 30, 45              # Prefect's shortest heartbeat; a zombie misses about one

PIPELINE = f"""
store = "{{store}}"
cache_dir = "{{cache}}"

[[models]]
name = "mlp"
factory = "tiny_models:mlp"
loss = "cross_entropy"
batch_sizes = [4]
inputs = [{{{{ shape = [8] }}}}, {{{{ shape = [], dtype = "int64", high = 4 }}}}]

[profile]
warmup = 0
repeats = 1
retries = 0

[[plans]]
solver = "ap-greedy"
budgets = ["90%"]

[deploy]
work_pool = "ops-fleet"
heartbeat_s = {HEARTBEAT_S}
zombie_after_s = {ZOMBIE_AFTER_S}

[[deploy.classes]]
name = "{CLASS}"
profile_cron = "0 3 * * *"
"""

# On the host whose worker has STALL_FILE set, building the model announces the flow process's pid there and
# stalls (until the test kills the host); elsewhere it builds the model.
MODELS = '''
import os, time
from torch import nn

def mlp():
    if os.environ.get("STALL_FILE"):
        with open(os.environ["STALL_FILE"], "w") as f:
            f.write(str(os.getpid()))
        time.sleep(600)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
'''


@pytest.fixture(scope="module")
def server(postgres, tmp_path_factory):
    """`prefect server start` on `postgres` with every service at its default (events, triggers, scheduler)."""
    with prefect_server_on(postgres, tmp_path_factory.mktemp("ops-server")) as api:
        yield api


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ops-project")
    (folder / "tiny_models.py").write_text(textwrap.dedent(MODELS))
    (folder / "pipeline.toml").write_text(PIPELINE.format(store=folder / "store", cache=folder / "cache"))
    return folder


def _memplan(api: str, *args: str):
    """`memplan ARGS` with PREFECT_API_URL pointing at `api`, as on an operator's shell."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from memplan.flows.cli import app

    with temporary_settings({PREFECT_API_URL: api}):
        return CliRunner().invoke(app, list(args), terminal_width=200)


def _deploy(api: str, config: Path, *args: str):
    return _memplan(api, "deploy", str(config), *args)


def _worker(api: str, project: Path, name: str, **env: str):
    environment = {**os.environ, "PREFECT_API_URL": api, "PREFECT_HOME": str(project / f"home-{name}"),
                   "MEMPLAN_DEVICE_KEY": CLASS, "PYTHONPATH": str(REPO), "PREFECT_WORKER_QUERY_SECONDS": "1",
                   "PREFECT_LOGGING_LEVEL": "WARNING", "OMP_NUM_THREADS": "1", **env}
    return started([str(Path(sys.executable).with_name("prefect")), "worker", "start", "--pool", "ops-fleet",
                    "--work-queue", CLASS, "--type", "process", "--limit", "1", "--name", name],
                   project / f"worker-{name}.log", env=environment, cwd=project)


def _logs(project: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-2500:]}" for p in project.glob("worker-*.log"))


@pytest.mark.fleet_e2e
def test_dry_run_changes_nothing_and_pause_stops_a_class(server, project):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import Scheduled

    def of(deployment) -> DeploymentFilter:
        return DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id]))

    config = project / "pipeline.toml"
    dry = _deploy(server, config, "--dry-run")
    assert dry.exit_code == 0, dry.output
    for what in ("work pool ops-fleet", f"deployment profile/{CLASS}@ops-fleet", "automation memplan ops-fleet: zombie runs"):
        assert f"{what}" in dry.output and "would be created" in dry.output, dry.output
    with temporary_settings({PREFECT_API_URL: server}), get_client(sync_client=True) as client:
        assert [d.name for d in client.read_deployments()] == [] and client.read_automations() == []
        assert _deploy(server, config).exit_code == 0
        again = _deploy(server, config)
        assert "created" not in again.output and "updated" not in again.output, again.output
        zombie, = client.read_automations_by_name("memplan ops-fleet: zombie runs")
        assert zombie.trigger.within.total_seconds() == ZOMBIE_AFTER_S
        assert [a.type for a in zombie.actions] == ["change-flow-run-state", "run-deployment"]
        deployment = client.read_deployment_by_name(f"profile/{CLASS}@ops-fleet")
        assert deployment.job_variables["env"]["MEMPLAN_DEVICE_CLASS"] == CLASS
        fit = client.read_deployment_by_name(f"fit/{CLASS}@ops-fleet")           # on demand: no schedule
        assert fit.entrypoint == "memplan.flows.fit:fit_flow" and not fit.schedules
        now = datetime.now(timezone.utc)
        waiting = [client.create_flow_run_from_deployment(deployment.id, state=Scheduled(scheduled_time=at))
                   for at in (now - timedelta(minutes=10), now + timedelta(hours=1))]       # a late slot, a later run
        waiting.append(client.create_flow_run_from_deployment(fit.id))                   # as the zombie re-run makes
        wait_until(lambda: any(r.auto_scheduled for r in client.read_flow_runs(deployment_filter=of(deployment))),
                   30, "the scheduler creating the cron runs")
        paused = _memplan(server, "fleet", "pause", str(config), "--class", CLASS)
        assert paused.exit_code == 0 and client.read_deployment(deployment.id).paused, paused.output
        assert client.read_deployment(fit.id).paused
        assert re.search(rf"profile/{CLASS}@ops-fleet\s+│ paused; 2 scheduled or late runs cancelled", paused.output), paused.output
        assert re.search(rf"fit/{CLASS}@ops-fleet\s+│ paused; 1 scheduled or late run cancelled", paused.output), paused.output
        assert all(client.read_flow_run(r.id).state.is_cancelled() for r in waiting)
        assert not [r for d in (deployment, fit) for r in client.read_flow_runs(deployment_filter=of(d))
                    if r.state.is_scheduled()], "a paused deployment keeps a run that would start"
        resumed = _memplan(server, "fleet", "resume", str(config))
        assert resumed.exit_code == 0 and not client.read_deployment(deployment.id).paused, resumed.output
        assert re.search(rf"profile/{CLASS}@ops-fleet\s+│ resumed \(was paused\)", resumed.output), resumed.output
        for run in waiting:                             # the next test counts the runs of the deployment
            client.delete_flow_run(run.id)


@pytest.mark.fleet_e2e
def test_one_run_at_a_time_per_host_and_a_dead_hosts_run_is_crashed_and_rerun(server, project):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from memplan.tasks.store.profiles import locate
    from memplan.tasks.store.query import query

    assert _deploy(server, project / "pipeline.toml").exit_code == 0
    marker = project / "stalled.pid"
    with temporary_settings({PREFECT_API_URL: server}), get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name(f"profile/{CLASS}@ops-fleet")
        of_deployment = DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id]))
        first, second = (client.create_flow_run_from_deployment(deployment.id) for _ in range(2))

        def states() -> dict:                               # the scheduler's cron runs (days ahead) left out
            return {r.id: r for r in client.read_flow_runs(deployment_filter=of_deployment) if not r.auto_scheduled}

        with _worker(server, project, "host-a", STALL_FILE=str(marker)) as host_a:
            wait_until(marker.exists, 90, "host-a starting a profile run", interval=0.5)
            for _ in range(10):                              # 5 s of host-a polling a queue with one more run
                running = [r for r in states().values() if r.state.is_running()]
                assert len(running) == 1, f"host-a (--limit 1) runs {len(running)} profiles at once"
                time.sleep(0.5)
            stalled = running[0].id
            waiting = second.id if stalled == first.id else first.id
            assert states()[waiting].state.is_scheduled(), states()[waiting].state
            with _worker(server, project, "host-b"):
                os.kill(int(marker.read_text()), signal.SIGKILL)      # the host dies: flow process and worker
                host_a.send_signal(signal.SIGKILL)
                stop(host_a)
                wait_until(lambda: states()[stalled].state.is_crashed(), ZOMBIE_AFTER_S + 45,
                           "the zombie automation marking the dead host's run crashed", interval=1)
                assert "No heartbeat" in states()[stalled].state.message

                def rerun_done() -> bool:
                    runs = states()
                    failed = [(r.name, r.state.message) for i, r in runs.items()
                              if i != stalled and r.state.is_final() and not r.state.is_completed()]
                    assert not failed, (failed, _logs(project))
                    return len(runs) == 3 and all(r.state.is_completed() for i, r in runs.items() if i != stalled)

                try:
                    wait_until(rerun_done, 120, "host-b completing the waiting run and the zombie's re-run", interval=1)
                except TimeoutError as exc:
                    seen = [(r.name, r.state.type.value, r.state.message, r.expected_start_time) for r in states().values()]
                    raise AssertionError(f"{exc}; runs: {seen}\n{_logs(project)}") from None
        done = sorted((r for i, r in states().items() if i != stalled), key=lambda r: r.start_time)
        assert done[0].end_time <= done[1].start_time, "host-b (--limit 1) ran two profiles at once"
    store = project / "store"
    assert len(locate(str(store)).parquet_files()) == 2
    assert not [p for p in store.rglob("*") if p.is_file() and not p.name.endswith(".parquet")]
    assert query("SELECT count(*) AS runs, bool_and(complete) AS complete FROM runs", str(store)).to_pylist() == [
        {"runs": 2, "complete": True}]


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (an unreaped zombie does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.fleet_e2e
def test_a_worker_killed_alone_takes_its_flow_process_along_and_the_run_is_rerun(server, project):
    from datetime import datetime, timezone

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    assert _deploy(server, project / "pipeline.toml").exit_code == 0
    marker = project / "alone.pid"
    since = datetime.now(timezone.utc)
    with temporary_settings({PREFECT_API_URL: server}), get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name(f"profile/{CLASS}@ops-fleet")
        of_deployment = DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id]))
        run = client.create_flow_run_from_deployment(deployment.id)

        def runs() -> dict:                                 # this test's: the earlier tests' and cron runs left out
            return {r.id: r for r in client.read_flow_runs(deployment_filter=of_deployment)
                    if not r.auto_scheduled and r.created >= since}

        with _worker(server, project, "host-c", STALL_FILE=str(marker)) as worker:
            wait_until(marker.exists, 90, "host-c starting the profile run", interval=0.5)
            flow_process = int(marker.read_text())
            worker.send_signal(signal.SIGKILL)                  # the worker alone, not its flow process
            worker.wait(10)
            wait_until(lambda: not _alive(flow_process), 15, "the flow process ending with its worker", interval=0.5)
        with _worker(server, project, "host-d"):
            try:
                wait_until(lambda: runs()[run.id].state.is_crashed() and len(runs()) == 2 and all(
                    r.state.is_completed() for i, r in runs().items() if i != run.id), ZOMBIE_AFTER_S + 150,
                    "the zombie automation crashing the run and host-d completing its re-run", interval=1)
            except TimeoutError as exc:
                seen = [(r.name, r.state.type.value, r.state.message) for r in runs().values()]
                raise AssertionError(f"{exc}; runs: {seen}\n{_logs(project)}") from None
        assert "No heartbeat" in runs()[run.id].state.message
