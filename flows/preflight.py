"""Checks a pipeline command makes before any stage runs: every folder it will write is a folder it can
write, and the Prefect API it will talk to answers. Each failure is one `MemplanError` naming the setting,
the value and the fix, seconds after the command starts rather than after tracing and profiling."""

from __future__ import annotations

import os
from pathlib import Path

from memplan.tasks.config import MemplanError, PipelineConfig
from memplan.tasks.store.profiles import is_url

API_TIMEOUT_S = 5.0


def check_writable_folder(key: str, location: str | os.PathLike) -> None:
    """`location` (the value of pipeline.toml's `key`) is a folder this process can write in, or can create:
    its nearest existing ancestor is a writable folder. Nothing is created here."""
    path = Path(location).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        where = "is a file" if existing == path else f"lies under {existing}, which is a file"
        raise MemplanError(f"{key} = {str(location)!r} {where}, not a folder; point {key} at a folder (it is "
                           f"created when missing) or move the file away.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise MemplanError(f"{key} = {str(location)!r} cannot be written: {existing} is not writable by this user; "
                           f"give a folder this user can write, or fix its permissions.")


def check_prefect_api() -> None:
    """The Prefect server named by PREFECT_API_URL, when one is, answers its health check."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        return                                    # Prefect's ephemeral local server, started by the run
    import httpx

    try:
        httpx.get(f"{url.rstrip('/')}/health", timeout=API_TIMEOUT_S).raise_for_status()
    except httpx.HTTPError as exc:
        raise MemplanError(f"PREFECT_API_URL = {url!r} does not answer ({type(exc).__name__}: {exc}); start that "
                           f"Prefect server, correct the URL, or unset PREFECT_API_URL to run on a local "
                           f"ephemeral server.") from None


def check_locations(config: PipelineConfig, *, publishes: bool) -> None:
    """The folders a run writes (cache, a local store, and when `publishes` the plans folder) and the Prefect
    API, checked before any stage."""
    check_writable_folder("cache_dir", config.cache_dir)
    if not is_url(config.store):
        check_writable_folder("store", config.store)
    if publishes:
        check_writable_folder("publish.dir", config.publish.dir)
    check_prefect_api()
