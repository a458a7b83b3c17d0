"""What a run of `memplan deploy`'s deployments takes, on loopback with every Prefect server service at its
default: `prefect deployment run fit/<class> --param model=... --param max_size=...` (as docs/config.md says)
starts a fit of that model that a worker completes; a parameter the flow does not have is refused by Prefect
with the list of those it has; a run of a two-model pipeline that names no model fails saying how to name
one; and a `fit_cron` that could never name one is refused by `memplan deploy`. Two fleets (work pools) with
the same class names on one server keep to their own deployments.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from .conftest import REPO, prefect_server_on, started, wait_until

CLASS = "cpu-fit"

PIPELINE = f"""
device = "cpu"
device_memory = "1 MiB"
store = "{{store}}"
cache_dir = "{{cache}}"

[[models]]
name = "small"
factory = "tiny_blocks:blocks"
kwargs = {{{{ width = 8, depth = 2 }}}}
loss = "mse"
inputs = [{{{{ shape = [8] }}}}, {{{{ shape = [8] }}}}]

[[models]]
name = "other"
factory = "tiny_blocks:blocks"
kwargs = {{{{ width = 8, depth = 3 }}}}
loss = "mse"
inputs = [{{{{ shape = [8] }}}}, {{{{ shape = [8] }}}}]

[profile]
warmup = 0
repeats = 1

[[plans]]
solver = "dtr"
max_overhead = 0.1

[validate]
steps = 1
max_steps = 1
warmup = 0

[deploy]
work_pool = "fit-fleet"

[[deploy.classes]]
name = "{CLASS}"
"""

MODELS = '''
from torch import nn

def blocks(width, depth):
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, 4 * width), nn.Tanh(), nn.Linear(4 * width, width))
                           for _ in range(depth)])
'''


@pytest.fixture(scope="module")
def server(postgres, tmp_path_factory):
    """`prefect server start` on `postgres` with every service at its default."""
    with prefect_server_on(postgres, tmp_path_factory.mktemp("deployments-server")) as api:
        yield api


def prefect(api: str, home: Path, *args: str) -> subprocess.CompletedProcess:
    """The `prefect` command, as an operator's shell runs it against `api`."""
    env = {**os.environ, "PREFECT_API_URL": api, "PREFECT_HOME": str(home), "COLUMNS": "200"}
    return subprocess.run([str(Path(sys.executable).with_name("prefect")), *args], env=env, capture_output=True,
                          text=True, timeout=180)


@pytest.mark.fleet_e2e
def test_fit_deployment_runs_take_their_parameters(server, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from memplan.flows.cli import app

    (tmp_path / "tiny_blocks.py").write_text(textwrap.dedent(MODELS))
    config = tmp_path / "pipeline.toml"
    config.write_text(PIPELINE.format(store=tmp_path / "store", cache=tmp_path / "cache"))
    with temporary_settings({PREFECT_API_URL: server}):
        scheduled = tmp_path / "scheduled.toml"
        scheduled.write_text(config.read_text().replace(f'name = "{CLASS}"', f'name = "{CLASS}"\nfit_cron = "0 4 * * *"'))
        refused = CliRunner().invoke(app, ["deploy", str(scheduled)], terminal_width=200)
        assert refused.exit_code == 1 and "fit_cron = '0 4 * * *' but no model to fit" in refused.output, refused.output
        deployed = CliRunner().invoke(app, ["deploy", str(config)], terminal_width=200)
        assert deployed.exit_code == 0, deployed.output
        again = CliRunner().invoke(app, ["deploy", str(config)], terminal_width=200)
        assert "created" not in again.output and "updated" not in again.output, again.output

    home = tmp_path / "cli-home"
    typo = prefect(server, home, "deployment", "run", f"fit/{CLASS}@fit-fleet", "--param", "modle=other")
    assert typo.returncode == 1 and "modle" in typo.stdout + typo.stderr and "model" in typo.stdout + typo.stderr
    started_runs = [prefect(server, home, "deployment", "run", f"fit/{CLASS}@fit-fleet", "--param", "model=other",
                            "--param", "max_size=4"),
                    prefect(server, home, "deployment", "run", f"fit/{CLASS}@fit-fleet")]
    assert all(r.returncode == 0 for r in started_runs), [r.stdout + r.stderr for r in started_runs]

    env = {**os.environ, "PREFECT_API_URL": server, "PREFECT_HOME": str(tmp_path / "worker-home"),
           "PYTHONPATH": str(REPO), "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_LOGGING_LEVEL": "WARNING",
           "OMP_NUM_THREADS": "1"}
    with temporary_settings({PREFECT_API_URL: server}), get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name(f"fit/{CLASS}@fit-fleet")
        assert set(deployment.parameter_openapi_schema["properties"]) == {
            "config_path", "model", "max_overhead", "solver", "max_size", "dimension", "batch_size"}
        with started([str(Path(sys.executable).with_name("prefect")), "worker", "start", "--pool", "fit-fleet",
                      "--work-queue", CLASS, "--type", "process", "--limit", "1"], tmp_path / "worker.log", env=env,
                     cwd=tmp_path):

            def runs() -> dict:
                return {json.dumps(r.parameters, sort_keys=True): r for r in client.read_flow_runs()
                        if r.deployment_id == deployment.id}

            try:
                wait_until(lambda: len(runs()) == 2 and all(r.state.is_final() for r in runs().values()), 300,
                           "the worker ending both fit runs", interval=2)
            except TimeoutError as exc:
                raise AssertionError(f"{exc}: {[(p, r.state) for p, r in runs().items()]}\n"
                                     f"{(tmp_path / 'worker.log').read_text()[-3000:]}") from None
        by_model = {r.parameters.get("model"): r for r in runs().values()}
    named, unnamed = by_model["other"], by_model[None]
    assert named.parameters == {"config_path": str(config), "model": "other", "max_size": 4}
    assert named.state.is_completed(), (named.state, (tmp_path / "worker.log").read_text()[-3000:])
    assert (tmp_path / "cache" / "reports" / "other-fit-batch.png").exists()
    assert not (tmp_path / "cache" / "reports" / "small-fit-batch.png").exists()
    assert unnamed.state.is_failed() and "--param model=NAME" in unnamed.state.message, unnamed.state


FLEET = """
[[models]]
name = "mlp"
factory = "tiny_blocks:blocks"
kwargs = {{ width = 8, depth = 2 }}
loss = "mse"
inputs = [{{ shape = [8] }}, {{ shape = [8] }}]

[[plans]]
solver = "dtr"
budgets = ["90%"]

[deploy]
work_pool = "{pool}"

[[deploy.classes]]
name = "gpu"
profile_cron = "{cron}"
"""


@pytest.mark.fleet_e2e
def test_two_fleets_with_the_same_classes_on_one_server_keep_apart(server, tmp_path):
    """Two projects, each its work pool, both with a class `gpu`: neither's deploy, pause or remove touches the
    other's deployments; a deploy removes its own pool's deployments named as before the pool was in the name."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from memplan.flows.cli import app

    configs = {}
    for pool, cron in (("fleet-a", "0 3 * * *"), ("fleet-b", "30 4 * * *")):
        (tmp_path / pool).mkdir()
        configs[pool] = tmp_path / pool / "pipeline.toml"
        configs[pool].write_text(FLEET.format(pool=pool, cron=cron))

    def memplan(*args: str) -> str:
        done = CliRunner().invoke(app, list(args), terminal_width=200)
        assert done.exit_code == 0, done.output
        return done.output

    with temporary_settings({PREFECT_API_URL: server}), get_client(sync_client=True) as client:
        def ours(pool: str) -> dict:
            return {d.id: d for d in client.read_deployments() if d.work_pool_name == pool}

        memplan("deploy", str(configs["fleet-a"]))
        a = ours("fleet-a")
        assert sorted(d.name for d in a.values()) == ["gpu@fleet-a"] * 3
        client.create_deployment(                               # as memplan made it before the pool was in the name
            flow_id=client.create_flow_from_name("profile"), name="gpu", work_pool_name="fleet-a",
            work_queue_name="gpu", entrypoint="memplan.flows.profile:profile_flow", tags=["memplan-pool:fleet-a"])

        dry = memplan("deploy", str(configs["fleet-b"]), "--dry-run")
        for flow in ("profile", "plan", "fit"):
            assert re.search(rf"deployment {flow}/gpu@fleet-b\s+│ would be created", dry), dry
        assert "fleet-a" not in dry and "profile/gpu " not in dry, dry
        memplan("deploy", str(configs["fleet-b"]))
        again = memplan("deploy", str(configs["fleet-a"]))
        assert re.search(r"deployment profile/gpu \(old name\)\s+│ removed", again), again
        assert "created" not in again and "updated" not in again, again
        assert set(ours("fleet-a")) == set(a)                     # the same three, the old one gone
        assert client.read_deployment_by_name("profile/gpu@fleet-b").schedules[0].schedule.cron == "30 4 * * *"
        assert client.read_deployment_by_name("profile/gpu@fleet-a").schedules[0].schedule.cron == "0 3 * * *"

        memplan("fleet", "pause", str(configs["fleet-b"]))
        assert all(d.paused for d in ours("fleet-b").values())
        assert not any(client.read_deployment(d.id).paused for d in a.values())
        removed = memplan("deploy", str(configs["fleet-b"]), "--remove")
        assert "fleet-a" not in removed, removed
        assert ours("fleet-b") == {} and set(ours("fleet-a")) == set(a)
        assert [x.name for x in client.read_automations() if x.name.startswith("memplan fleet-")] == [
            "memplan fleet-a: zombie runs"]
