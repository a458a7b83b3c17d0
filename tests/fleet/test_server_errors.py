"""`memplan deploy` and `memplan fleet pause` against a Prefect server with basic auth
(PREFECT_SERVER_API_AUTH_STRING), run as an operator runs them (the `memplan` command in a shell): a missing or
wrong PREFECT_API_AUTH_STRING, or a PREFECT_API_URL the server answers with an error, stops the command with
one paragraph naming the setting and the fix and exit status 1, never a traceback (but with --debug), and never
the password; the right one deploys.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from .conftest import prefect_server_on

AUTH = "memplan:s3cret-pw"

PIPELINE = """
[[models]]
name = "mlp"
factory = "tiny_models:mlp"
loss = "cross_entropy"
batch_sizes = [4]
inputs = [{ shape = [8] }, { shape = [], dtype = "int64", high = 4 }]

[[plans]]
solver = "ap-greedy"
budgets = ["90%"]

[deploy]
work_pool = "auth-fleet"

[[deploy.classes]]
name = "cpu-auth"
"""


@pytest.fixture(scope="module")
def server(postgres, tmp_path_factory):
    """`prefect server start` on `postgres` with basic auth, every service at its default."""
    with prefect_server_on(postgres, tmp_path_factory.mktemp("auth-server"),
                           {"PREFECT_SERVER_API_AUTH_STRING": AUTH}) as api:
        yield api


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("auth-project")
    (folder / "pipeline.toml").write_text(textwrap.dedent(PIPELINE))
    return folder / "pipeline.toml"


def memplan(config: Path, api: str, auth: str | None, *args: str) -> subprocess.CompletedProcess:
    """`memplan ARGS` in a shell whose PREFECT_API_URL is `api` and PREFECT_API_AUTH_STRING `auth` (unset: None)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_API_URL=api, PREFECT_HOME=str(config.parent / "home"), COLUMNS="200")
    if auth is not None:
        env["PREFECT_API_AUTH_STRING"] = auth
    return subprocess.run([str(Path(sys.executable).with_name("memplan")), *args], env=env, cwd=config.parent,
                          capture_output=True, text=True, timeout=180)


def one_paragraph(done: subprocess.CompletedProcess, *phrases: str) -> str:
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr)
    message = done.stderr.strip()
    assert message.startswith("error: ") and "\n" not in message and "Traceback" not in message, message
    assert "s3cret" not in message and "s3cret" not in done.stdout, message
    for phrase in phrases:
        assert phrase in message, message
    return message


@pytest.mark.fleet_e2e
def test_missing_or_wrong_credentials_and_server_errors_are_one_paragraph(server, config):
    missing = memplan(config, server, None, "deploy", str(config))
    one_paragraph(missing, "requires a login (401 Unauthorized)", "PREFECT_API_AUTH_STRING is not set",
                  "PREFECT_SERVER_API_AUTH_STRING", f"PREFECT_API_URL={server}")
    wrong = memplan(config, server, "memplan:wrong", "deploy", str(config))
    one_paragraph(wrong, "refused PREFECT_API_AUTH_STRING (401 Unauthorized)", "Correct PREFECT_API_AUTH_STRING")
    for command in (("fleet", "pause", str(config)), ("fleet", "resume", str(config)),
                    ("deploy", str(config), "--remove")):
        one_paragraph(memplan(config, server, "memplan:wrong", *command), "refused PREFECT_API_AUTH_STRING")
    not_api = server.removesuffix("/api")          # the server's root, not its API
    one_paragraph(memplan(config, not_api, AUTH, "deploy", str(config)), "answered 404 Not Found to GET /health",
                  "names that server's /api")
    debug = memplan(config, server, "memplan:wrong", "deploy", str(config), "--debug")
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "401" in debug.stderr, debug.stderr[-2000:]


@pytest.mark.fleet_e2e
def test_the_servers_credentials_deploy_and_pause(server, config):
    deployed = memplan(config, server, AUTH, "deploy", str(config))
    assert deployed.returncode == 0 and "created" in deployed.stdout, deployed.stdout + deployed.stderr
    paused = memplan(config, server, AUTH, "fleet", "pause", str(config))
    assert paused.returncode == 0 and "paused" in paused.stdout, paused.stdout + paused.stderr
