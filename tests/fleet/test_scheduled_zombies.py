"""Cron runs under the zombie automation, as a fleet runs them: Prefect's scheduler creates every-minute
profile runs of `memplan deploy`'s deployment, one worker completes them, and the zombie and failed-run
automations (a webhook notification block) watch them, every server service at its default. Over three cron
slots each slot has exactly one run, completed; none is marked crashed, none is re-run, no alert is sent.

(The scheduler inserts its runs' SCHEDULED state without an event, and the runs' later state events name that
event as the one they follow: the trigger service held them back for 15 minutes while heartbeats went through,
so the zombie automation saw heartbeats stop without a terminal state, crashed each completed run and ran it
again. flows/run_events.py sends the missing event when such a run starts.)
"""

from __future__ import annotations

import os
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from .conftest import REPO, free_port, prefect_server_on, started, wait_until

HEARTBEAT_S, ZOMBIE_AFTER_S = 30, 45
SLOTS = 3

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
work_pool = "cron-fleet"
heartbeat_s = {HEARTBEAT_S}
zombie_after_s = {ZOMBIE_AFTER_S}
notify_block = "custom-webhook/memplan-alerts"

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
def alerts():
    """A webhook receiver on 127.0.0.1: yields (its URL, the bodies it was sent)."""
    received: list[str] = []

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self):
            received.append(self.rfile.read(int(self.headers.get("Content-Length", 0))).decode())
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", free_port()), Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/alert", received
    finally:
        server.shutdown()
        thread.join(10)


@pytest.fixture
def server(postgres, tmp_path):
    """`prefect server start` on `postgres` with every service at its default (scheduler, events, triggers)."""
    home = tmp_path / "server-home"
    home.mkdir()
    with prefect_server_on(postgres, home) as api:
        yield api


@pytest.mark.fleet_e2e
def test_completed_cron_runs_are_never_taken_for_zombies(server, alerts, tmp_path):
    from prefect.blocks.notifications import CustomWebhookNotificationBlock
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from memplan.flows.commands.deploy import deploy
    from memplan.tasks.config import load_config

    url, received = alerts
    project = tmp_path / "project"
    project.mkdir()
    (project / "tiny_models.py").write_text(textwrap.dedent(MODELS))
    config = project / "pipeline.toml"
    config.write_text(PIPELINE.format(store=tmp_path / "store", cache=tmp_path / "cache"))
    env = {**os.environ, "PREFECT_API_URL": server, "PREFECT_HOME": str(tmp_path / "worker-home"),
           "MEMPLAN_DEVICE_KEY": "cpu-cron", "PYTHONPATH": str(REPO), "PREFECT_WORKER_QUERY_SECONDS": "1",
           "PREFECT_LOGGING_LEVEL": "WARNING", "OMP_NUM_THREADS": "1"}
    with temporary_settings({PREFECT_API_URL: server}), get_client(sync_client=True) as client:
        CustomWebhookNotificationBlock(name="memplan alert", url=url, json_data={"text": "{{body}}"}).save("memplan-alerts")
        done = dict(deploy(config, load_config(config).deploy))
        assert done["automation memplan cron-fleet: zombie runs"] == "created", done
        assert done["automation memplan cron-fleet: failed runs"] == "created", done
        deployment = client.read_deployment_by_name("profile/cpu-cron@cron-fleet")
        of_deployment = DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id]))
        log = tmp_path / "worker.log"

        def runs() -> list:
            return client.read_flow_runs(deployment_filter=of_deployment)

        def seen() -> str:
            return "; ".join(f"{r.name} {r.expected_start_time:%H:%M:%S} auto={r.auto_scheduled} {r.state.type.value} "
                             f"{r.state.message!r}" for r in runs() if not r.state.is_scheduled())

        with started([str(Path(sys.executable).with_name("prefect")), "worker", "start", "--pool", "cron-fleet",
                      "--work-queue", "cpu-cron", "--type", "process", "--limit", "1"], log, env=env, cwd=project):

            def completed() -> list:
                wrong = [r for r in runs() if r.state.is_final() and not r.state.is_completed()]
                assert not wrong, (seen(), log.read_text()[-3000:])
                return [r for r in runs() if r.state.is_completed()]

            try:
                wait_until(lambda: len(completed()) >= SLOTS, 60 * (SLOTS + 2), f"{SLOTS} cron runs completing",
                           interval=2)
                last = max(r.end_time for r in completed())
                # the zombie automation would crash a run ZOMBIE_AFTER_S after its last heartbeat seen
                wait_until(lambda: time.time() > last.timestamp() + ZOMBIE_AFTER_S + HEARTBEAT_S + 15,
                           ZOMBIE_AFTER_S + HEARTBEAT_S + 60, "the zombie automation's window passing", interval=2)
            except TimeoutError as exc:
                raise AssertionError(f"{exc}; runs: {seen()}\n{log.read_text()[-3000:]}") from None
            final = [r for r in runs() if r.state.is_final()]
        assert all(r.auto_scheduled for r in runs()), f"a run not made by the scheduler (a re-run): {seen()}"
        assert all(r.state.is_completed() for r in final), seen()
        slots = sorted(r.expected_start_time for r in final)
        assert len(slots) >= SLOTS and len(set(slots)) == len(slots), f"a slot ran twice: {seen()}"
        assert all(s.second == 0 for s in slots), seen()
        for run in final:
            assert [s.type.value for s in client.read_flow_run_states(run.id)][-1] == "COMPLETED", run.name
    assert received == [], f"alerts sent for healthy cron runs: {received}"
