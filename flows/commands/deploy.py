"""`memplan deploy [pipeline.toml]`: Prefect deployments of the `profile`, `plan` and `fit` flows for a fleet.

From the `[deploy]` section (docs/config.md, docs/fleet.md): one process work pool, one work queue per
device class, and per class the deployments `profile/<class>@<pool>` (on its `profile_cron`),
`plan/<class>@<pool>` (on its `plan_cron`, or on demand) and `fit/<class>@<pool>` (on its `fit_cron`, or on
demand: what fits this class's device), each with its flow's parameter schema (`prefect deployment run
--param`), on the Prefect server in `PREFECT_API_URL`. Idempotent: a deployment,
pool, queue or automation that already matches is left untouched (reported `unchanged`), so deploying twice
changes nothing on the server; `--dry-run` says what would change and changes nothing. Every run gets
`$MEMPLAN_DEVICE_CLASS` (the plans index records it), heartbeats every `heartbeat_s` and `flow_retries`
retries; the automations of flows/automations.py crash and re-run zombies and send failures to
`notify_block`. `--remove` deletes what `memplan deploy` made (deployments, automations; runs and the pool's
queues stay).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Annotated, Any

import typer

from memplan.flows.automations import ensure_automations, pool_tag
from memplan.flows.prefect_server import DeployError, api_url, server_errors
from memplan.tasks.config import DeployConfig
from memplan.tasks.publish import DEVICE_CLASS_VAR

ENTRYPOINTS = {"profile": "memplan.flows.profile:profile_flow", "plan": "memplan.flows.plan:plan_flow", "fit": "memplan.flows.fit:fit_flow"}


def results_env(deploy: DeployConfig, directory: Path, config_path: Path, cache_dir: str | None) -> dict[str, str]:
    """Where deployment runs keep Prefect's results, as JSON (never pickle): the storage block
    `result_storage`, else `<cache_dir>/prefect` on the shared project folder (as `memplan run` does), not
    each worker's home."""
    env = {"PREFECT_RESULTS_DEFAULT_SERIALIZER": "json"}
    if deploy.result_storage:
        return {**env, "PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK": deploy.result_storage}
    cache = Path(cache_dir or ".cache/memplan")
    if cache.is_absolute():
        try:                                   # the deploying host's path to the project -> the workers' path
            cache = cache.relative_to(config_path.resolve().parent)
        except ValueError:
            return {**env, "PREFECT_LOCAL_STORAGE_PATH": str(cache / "prefect")}
    return {**env, "PREFECT_LOCAL_STORAGE_PATH": str(directory / cache / "prefect")}


@cache
def parameter_schema(flow: str) -> dict[str, Any]:
    """The JSON schema of what a run of `flow`'s deployment may set (`prefect deployment run --param`, the UI's
    form): every parameter of the flow function but `config` (the parsed file, for in-process callers), read
    from its source."""
    from prefect.utilities.callables import parameter_schema_from_entrypoint

    schema = parameter_schema_from_entrypoint(ENTRYPOINTS[flow].replace(":", ".")).model_dump_for_openapi()
    schema["properties"].pop("config")
    schema.pop("definitions", None)             # only `config`'s types
    return schema


def check_scheduled_fits(config) -> None:
    """Refuse a `fit_cron` that would fail every time: a pipeline of several models whose class does not name
    one in `fit_parameters` (a scheduled run gets no parameters of its own)."""
    from memplan.tasks.config import ConfigError

    names = [m.name for m in config.models]
    for cls in config.deploy.classes:
        if cls.fit_cron and len(names) > 1 and "model" not in cls.fit_parameters:
            raise ConfigError(
                f"[[deploy.classes]] {cls.name!r} has fit_cron = {cls.fit_cron!r} but no model to fit: the pipeline "
                f"declares {len(names)} models ({', '.join(names)}). Name one in its fit_parameters, e.g. "
                f"fit_parameters = {{ model = \"{names[0]}\" }}, or remove fit_cron and run `prefect deployment run "
                f"fit/{deployment_name(config.deploy, cls.name)} --param model=NAME` when needed (docs/fleet.md).")


def deployment_name(deploy: DeployConfig, class_name: str) -> str:
    """The name of a class's deployments, `<class>@<work pool>` (`prefect deployment run fit/h100@gpu-fleet`): a
    deployment's name is unique per flow on the whole server, so two fleets (work pools) keep apart."""
    return f"{class_name}@{deploy.work_pool}"


def desired_deployments(deploy: DeployConfig, config_path: Path, cache_dir: str | None = None) -> list[dict[str, Any]]:
    """What `memplan deploy` puts on the server: one dict of `create_deployment` arguments (plus `flow`)
    per (flow, device class); `cache_dir` is the pipeline's (its results go to `<cache_dir>/prefect`)."""
    directory = Path(deploy.directory) if deploy.directory else config_path.resolve().parent
    config_file = str(directory / config_path.name)
    results = results_env(deploy, directory, config_path, cache_dir)
    wanted = []
    for cls in deploy.classes:
        for flow, cron, extra in (("profile", cls.profile_cron, cls.profile_parameters),
                                  ("plan", cls.plan_cron, cls.plan_parameters),
                                  ("fit", cls.fit_cron, cls.fit_parameters)):
            wanted.append(dict(
                flow=flow, name=deployment_name(deploy, cls.name), work_pool_name=deploy.work_pool,
                work_queue_name=cls.name,
                entrypoint=ENTRYPOINTS[flow], path=str(directory),
                pull_steps=[{"prefect.deployments.steps.set_working_directory": {"directory": str(directory)}}],
                parameters={"config_path": config_file, **extra}, parameter_openapi_schema=parameter_schema(flow),
                schedules=[] if cron is None else [(cron, cls.timezone)],
                job_variables={"env": {DEVICE_CLASS_VAR: cls.name,
                                       "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(deploy.heartbeat_s),
                                       "PREFECT_FLOWS_DEFAULT_RETRIES": str(deploy.flow_retries), **results}},
                tags=["memplan", f"device-class:{cls.name}", pool_tag(deploy.work_pool)],
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
        parameter_openapi_schema=found.parameter_openapi_schema,
        schedules=[(s.schedule.cron, s.schedule.timezone) for s in found.schedules],
        job_variables=found.job_variables, tags=sorted(found.tags), description=found.description,
    )


def _remove_unnamespaced(client, deploy: DeployConfig, dry_run: bool) -> list[tuple[str, str]]:
    """Delete this pool's deployments named `<flow>/<class>` (memplan before the pool was in the name): they
    would keep their schedules beside the new ones. Another pool's are left alone."""
    from prefect.exceptions import ObjectNotFound

    done = []
    for cls in deploy.classes:
        for flow in ENTRYPOINTS:
            try:
                old = client.read_deployment_by_name(f"{flow}/{cls.name}")
            except ObjectNotFound:
                continue
            if old.work_pool_name == deploy.work_pool and pool_tag(deploy.work_pool) in old.tags:
                if not dry_run:
                    client.delete_deployment(old.id)
                done.append((f"deployment {flow}/{cls.name} (old name)", "would be removed" if dry_run else "removed"))
    return done


def _ensure_pool(client, deploy: DeployConfig, dry_run: bool) -> list[tuple[str, str]]:
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound

    would = "would be " if dry_run else ""
    done = []
    try:
        pool = client.read_work_pool(deploy.work_pool)
        if pool.type != "process":
            raise DeployError(f"Work pool {deploy.work_pool!r} on the server is of type {pool.type!r}; memplan's "
                              f"workers run flows as local processes on the GPU hosts. Name another pool in "
                              f"[deploy] work_pool or delete that one (`prefect work-pool delete`).")
        done.append((f"work pool {deploy.work_pool}", "unchanged"))
    except ObjectNotFound:
        if not dry_run:
            client.create_work_pool(WorkPoolCreate(name=deploy.work_pool, type="process"))
        done.append((f"work pool {deploy.work_pool}", would + "created"))
    for cls in deploy.classes:
        label = f"work queue {cls.name}"
        try:
            queue = client.read_work_queue_by_name(cls.name, work_pool_name=deploy.work_pool)
        except ObjectNotFound:
            if not dry_run:
                client.create_work_queue(name=cls.name, work_pool_name=deploy.work_pool, concurrency_limit=cls.concurrency,
                                         description=f"GPU hosts of device class {cls.name}")
            done.append((label, would + "created"))
            continue
        if queue.concurrency_limit == cls.concurrency:
            done.append((label, "unchanged"))
            continue
        if not dry_run:
            client.update_work_queue(queue.id, concurrency_limit=cls.concurrency)
        done.append((label, would + "updated"))
    return done


def deploy(config_path: Path, deploy_config: DeployConfig, dry_run: bool = False,
           cache_dir: str | None = None) -> list[tuple[str, str]]:
    """Create or update the pool, queues, deployments and automations; return (object, status), status
    created|updated|unchanged (`would be created|updated` and no change on the server when `dry_run`)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import DeploymentScheduleCreate
    from prefect.client.schemas.schedules import CronSchedule

    api_url()
    with server_errors(), get_client(sync_client=True) as client:
        done = _ensure_pool(client, deploy_config, dry_run)
        for want in desired_deployments(deploy_config, config_path, cache_dir):
            label = f"deployment {want['flow']}/{want['name']}"
            have = _current(client, want["flow"], want["name"])
            if have == {**want, "tags": sorted(want["tags"])}:
                done.append((label, "unchanged"))
                continue
            if not dry_run:
                arguments = {k: v for k, v in want.items() if k not in ("flow", "schedules")}
                client.create_deployment(
                    flow_id=client.create_flow_from_name(want["flow"]), **arguments,
                    schedules=[DeploymentScheduleCreate(schedule=CronSchedule(cron=cron, timezone=zone))
                               for cron, zone in want["schedules"]])
            done.append((label, ("would be " if dry_run else "") + ("created" if have is None else "updated")))
        done += _remove_unnamespaced(client, deploy_config, dry_run)
        done += ensure_automations(client, deploy_config, dry_run)
    return done


def remove(config_path: Path, deploy_config: DeployConfig, dry_run: bool = False) -> list[tuple[str, str]]:
    """Delete the deployments and automations `deploy` made for `deploy_config`; return (object, status)."""
    from prefect.client.orchestration import get_client

    api_url()
    done = []
    with server_errors(), get_client(sync_client=True) as client:
        for want in desired_deployments(deploy_config, config_path):
            label = f"deployment {want['flow']}/{want['name']}"
            if _current(client, want["flow"], want["name"]) is None:
                done.append((label, "absent"))
                continue
            if not dry_run:
                client.delete_deployment(client.read_deployment_by_name(f"{want['flow']}/{want['name']}").id)
            done.append((label, "would be removed" if dry_run else "removed"))
        for automation in client.read_automations():
            if automation.name.startswith(f"memplan {deploy_config.work_pool}: "):
                if not dry_run:
                    client.delete_automation(automation.id)
                done.append((f"automation {automation.name}", "would be removed" if dry_run else "removed"))
    return done


def register(app: typer.Typer) -> None:
    @app.command("deploy")
    def deploy_command(
        config: Annotated[Path, typer.Argument(help="The pipeline file with a \\[deploy] section.")] = Path("pipeline.toml"),
        dry_run: Annotated[bool, typer.Option("--dry-run", help="Say what would change on the server; change nothing.")] = False,
        remove_all: Annotated[bool, typer.Option("--remove", help="Delete the deployments and automations of "
                                                 "\\[deploy] instead (runs, pool and queues stay).")] = False,
        debug: Annotated[bool, typer.Option(help="Show the traceback of a failure.")] = False,
    ) -> None:
        """Create the fleet's Prefect deployments (profile, plan and fit flows per device class) and automations
        from \\[deploy]."""
        from memplan.flows.console import console, exit_on_error

        with exit_on_error(debug):
            from rich.table import Table

            from memplan.tasks.config import ConfigError, load_config

            loaded = load_config(config)
            if loaded.deploy is None:
                raise ConfigError(f"{config} has no [deploy] section: declare the work pool and the device "
                                  f"classes to deploy (docs/config.md, docs/fleet.md).")
            if not remove_all:
                check_scheduled_fits(loaded)
            title = f"memplan deploy {config}" + (" --remove" if remove_all else "") + (" --dry-run" if dry_run else "")
            table = Table("object", "status", title=title)
            done = remove(config, loaded.deploy, dry_run) if remove_all else \
                deploy(config, loaded.deploy, dry_run, loaded.cache_dir)
            for what, status in done:
                table.add_row(what, status)
            console().print(table)
