"""The Prefect server of `memplan deploy` and `memplan fleet`: its URL checked to answer and to accept
memplan's credentials, and every refusal or failure of the server as one paragraph naming the setting and
the fix (`DeployError`)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from memplan.tasks.config import MemplanError


class DeployError(MemplanError):
    """No Prefect server, one that refuses memplan's credentials or fails a request, or one whose pool does
    not fit."""


def _unauthorized(url: str) -> DeployError:
    from prefect.settings import PREFECT_API_AUTH_STRING

    if PREFECT_API_AUTH_STRING.value() is None:
        return DeployError(
            f"The Prefect server at PREFECT_API_URL={url} requires a login (401 Unauthorized) and "
            "PREFECT_API_AUTH_STRING is not set. Export PREFECT_API_AUTH_STRING='user:password', the value of the "
            "server's PREFECT_SERVER_API_AUTH_STRING (e.g. `export PREFECT_API_AUTH_STRING=\"memplan:$(cat "
            "/etc/memplan/prefect-api-password)\"`, docs/fleet.md section 2), then run the command again.")
    return DeployError(
        f"The Prefect server at PREFECT_API_URL={url} refused PREFECT_API_AUTH_STRING (401 Unauthorized): it must "
        "equal the server's PREFECT_SERVER_API_AUTH_STRING, 'user:password' with the same user and password. "
        "Correct PREFECT_API_AUTH_STRING in this shell (or the worker's environment) and run the command again "
        "(docs/fleet.md section 2).")


def _failed(url: str, exc: Exception) -> DeployError:
    import httpx

    if isinstance(exc, httpx.HTTPStatusError):
        response = exc.response
        if response.status_code == 401:
            return _unauthorized(url)
        request = f"{exc.request.method} {exc.request.url.path}"
        detail = response.text.strip()[:300] or response.reason_phrase
        if response.status_code >= 500:
            fix = ("The server failed: read its log (the output of `prefect server start`, e.g. `journalctl -u "
                   "prefect-server`), check its database (PREFECT_API_DATABASE_CONNECTION_URL on the server host) "
                   "and run the command again.")
        else:
            fix = ("The server refused memplan's request: install the same Prefect version on the server and here "
                   "(`pip install -c constraints.txt`), and check that PREFECT_API_URL names that server's /api.")
        return DeployError(f"The Prefect server at PREFECT_API_URL={url} answered {response.status_code} "
                           f"{response.reason_phrase} to {request} ({detail}). {fix}")
    return DeployError(
        f"The Prefect server at PREFECT_API_URL={url} cannot be reached ({type(exc).__name__}: {exc}). Check that "
        "`prefect server start` is running there and that the URL ends in /api, or set PREFECT_API_URL to the "
        "server's address (docs/fleet.md).")


def api_url() -> str:
    """The server's API URL, checked to answer within a few seconds and to accept PREFECT_API_AUTH_STRING;
    `DeployError` says how to get one."""
    import httpx
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        raise DeployError(
            "PREFECT_API_URL is not set: `memplan deploy` creates deployments on a Prefect server, and "
            "Prefect's temporary local server forgets them when the command ends. Start a server (`prefect "
            "server start`, backed by PostgreSQL for a fleet: docs/fleet.md) and point memplan at it with "
            "`export PREFECT_API_URL=http://<host>:4200/api`.")
    try:
        httpx.get(f"{url.rstrip('/')}/health", timeout=5).raise_for_status()
    except httpx.HTTPError as exc:
        raise _failed(url, exc) from exc
    with server_errors(), get_client(sync_client=True) as client:
        client.read_work_pools(limit=1)                # the first request that needs the credentials
    return url


@contextmanager
def server_errors() -> Iterator[None]:
    """Turn the Prefect client's HTTP failures (a refused login, a server error, a lost connection) into a
    `DeployError` naming PREFECT_API_URL or PREFECT_API_AUTH_STRING and the fix."""
    import httpx
    from prefect.settings import PREFECT_API_URL

    try:
        yield
    except httpx.HTTPError as exc:
        raise _failed(PREFECT_API_URL.value(), exc) from exc
