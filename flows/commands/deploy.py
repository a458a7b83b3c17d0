"""`memplan deploy [pipeline.toml]`: Prefect deployments of the `profile` and `plan` flows for a fleet.

From the `[deploy]` section (docs/config.md, docs/fleet.md): one process work pool, one work queue per
device class, and per class the deployments `profile/<class>` (on its `profile_cron`) and `plan/<class>`
(on its `plan_cron`, or on demand), on the Prefect server in `PREFECT_API_URL`. Idempotent: a deployment,
pool or queue that already matches is left untouched (reported `unchanged`), so deploying twice changes
nothing on the server.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from tasks.config import DeployConfig, MemplanError

ENTRYPOINTS = {"profile": "flows.profile:profile_flow", "plan": "flows.plan:plan_flow"}


class DeployError(MemplanError):
    """No Prefect server to deploy to, or one whose pool does not fit."""


def api_url() -> str:
    """The server's API URL, checked to answer within a few seconds; `DeployError` says how to get one."""
    import httpx
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
        raise DeployError(
            f"The Prefect server at PREFECT_API_URL={url} cannot be reached ({type(exc).__name__}: {exc}). "
            "Check that `prefect server start` is running there and that the URL ends in /api, or set "
            "PREFECT_API_URL to the server's address (docs/fleet.md).") from None
    return url


def desired_deployments(deploy: DeployConfig, config_path: Path) -> list[dict[str, Any]]:
    """What `memplan deploy` puts on the server: one dict of `create_deployment` arguments (plus `flow`)
    per (flow, device class)."""
    directory = Path(deploy.directory) if deploy.directory else config_path.resolve().parent
    config_file = str(directory / config_path.name)
    wanted = []
    for cls in deploy.classes:
        for flow, cron, extra in (("profile", cls.profile_cron, cls.profile_parameters),
                                  ("plan", cls.plan_cron, cls.plan_parameters)):
            wanted.append(dict(
                flow=flow, name=cls.name, work_pool_name=deploy.work_pool, work_queue_name=cls.name,
                entrypoint=ENTRYPOINTS[flow], path=str(directory),
                pull_steps=[{"prefect.deployments.steps.set_working_directory": {"directory": str(directory)}}],
                parameters={"config_path": config_file, **extra},
                schedules=[] if cron is None else [(cron, cls.timezone)],
                tags=["memplan", f"device-class:{cls.name}"],
                description=f"memplan {flow} flow for device class {cls.name} (device key {cls.device_key}); "
                            f"made by `memplan deploy {config_path.name}`.",
            ))
    return wanted


def _current(client, flow: str, name: str) -> dict[str, Any] | None:
    from prefect.exceptions import ObjectNotFound

    try:
        found = client.read_deployment_by_name(f"{flow}/{name}")
    except ObjectNotFound:
        return None
    return dict(
        flow=flow, name=name, work_pool_name=found.work_pool_name, work_queue_name=found.work_queue_name,
        entrypoint=found.entrypoint, path=found.path, pull_steps=found.pull_steps, parameters=found.parameters,
        schedules=[(s.schedule.cron, s.schedule.timezone) for s in found.schedules],
        tags=sorted(found.tags), description=found.description,
    )


def _ensure_pool(client, deploy: DeployConfig) -> list[tuple[str, str]]:
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound

    done = []
    try:
        pool = client.read_work_pool(deploy.work_pool)
        if pool.type != "process":
            raise DeployError(f"Work pool {deploy.work_pool!r} on the server is of type {pool.type!r}; memplan's "
                              f"workers run flows as local processes on the GPU hosts. Name another pool in "
                              f"[deploy] work_pool or delete that one (`prefect work-pool delete`).")
        done.append((f"work pool {deploy.work_pool}", "unchanged"))
    except ObjectNotFound:
        client.create_work_pool(WorkPoolCreate(name=deploy.work_pool, type="process"))
        done.append((f"work pool {deploy.work_pool}", "created"))
    for cls in deploy.classes:
        try:
            client.read_work_queue_by_name(cls.name, work_pool_name=deploy.work_pool)
            done.append((f"work queue {cls.name}", "unchanged"))
        except ObjectNotFound:
            client.create_work_queue(name=cls.name, work_pool_name=deploy.work_pool,
                                     description=f"GPU hosts of device class {cls.name}")
            done.append((f"work queue {cls.name}", "created"))
    return done


def deploy(config_path: Path, deploy_config: DeployConfig) -> list[tuple[str, str]]:
    """Create or update the pool, queues and deployments; return (object, created|updated|unchanged)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import DeploymentScheduleCreate
    from prefect.client.schemas.schedules import CronSchedule

    api_url()
    with get_client(sync_client=True) as client:
        done = _ensure_pool(client, deploy_config)
        for want in desired_deployments(deploy_config, config_path):
            label = f"deployment {want['flow']}/{want['name']}"
            have = _current(client, want["flow"], want["name"])
            if have == {**want, "tags": sorted(want["tags"])}:
                done.append((label, "unchanged"))
                continue
            arguments = {k: v for k, v in want.items() if k not in ("flow", "schedules")}
            client.create_deployment(
                flow_id=client.create_flow_from_name(want["flow"]), **arguments,
                schedules=[DeploymentScheduleCreate(schedule=CronSchedule(cron=cron, timezone=zone))
                           for cron, zone in want["schedules"]])
            done.append((label, "created" if have is None else "updated"))
    return done


def register(app: typer.Typer) -> None:
    @app.command("deploy")
    def deploy_command(
        config: Annotated[Path, typer.Argument(help="The pipeline file with a \\[deploy] section.")] = Path("pipeline.toml"),
    ) -> None:
        """Create the fleet's Prefect deployments (profile and plan flows per device class) from \\[deploy]."""
        from flows.console import console, exit_on_error

        with exit_on_error():
            from rich.table import Table

            from tasks.config import ConfigError, load_config

            loaded = load_config(config)
            if loaded.deploy is None:
                raise ConfigError(f"{config} has no [deploy] section: declare the work pool and the device "
                                  f"classes to deploy (docs/config.md, docs/fleet.md).")
            table = Table("object", "status", title=f"memplan deploy {config}")
            for what, status in deploy(config, loaded.deploy):
                table.add_row(what, status)
            console().print(table)
