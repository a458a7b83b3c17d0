"""The fleet tables of `pipeline.toml` (docs/fleet.md): device classes with their cron schedules, and
the deployment."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import AfterValidator, Field, field_validator, model_validator

from memplan.tasks.config.sections import Section

def _cron(expression: str) -> str:
    """`expression` when Prefect's public cron schedule takes it (and it has the five usual fields)."""
    from prefect.client.schemas.schedules import CronSchedule

    try:
        CronSchedule(cron=expression)
    except ValueError:
        valid = False
    else:
        valid = True
    if len(expression.split()) != 5 or not valid:
        raise ValueError(f"{expression!r} is not a cron expression; write five fields 'minute hour day month "
                         f"weekday', e.g. '0 3 * * *' (03:00 daily)")
    return expression


Cron = Annotated[str, AfterValidator(_cron)]


FIT_PARAMETERS = ("model", "max_overhead", "solver", "max_size", "dimension", "batch_size")
"""The `fit` flow's parameters a deployment may set (`flows.fit.fit_flow`; `config_path` is `memplan deploy`'s)."""


class DeviceClassConfig(Section):
    """One GPU class of the fleet: a work queue its hosts' workers poll, and when to profile, plan and fit."""

    name: str = Field(description="The class (and its work queue) name, e.g. 'h100'.")
    device: str | None = Field(None, description="The device key its hosts write into the profile store "
                               "(`memplan query \"SELECT DISTINCT device FROM runs\"`); default: `name`.")
    profile_cron: Cron = Field("0 3 * * *", description="When the `profile` flow runs (cron, in `timezone`).")
    plan_cron: Cron | None = Field(None, description="When the `plan` flow runs (cron); none: planned on demand.")
    fit_cron: Cron | None = Field(None, description="When the `fit` flow runs (cron); none: on demand.")
    timezone: str = Field("UTC", description="IANA time zone of the cron expressions.")
    profile_parameters: dict[str, Any] = Field(
        default_factory=dict, description="Extra parameters of the profile flow's runs, e.g. {reuse = true}.")
    plan_parameters: dict[str, Any] = Field(
        default_factory=dict, description="Extra parameters of the plan flow's runs, e.g. {refresh = true}.")
    fit_parameters: dict[str, Any] = Field(
        default_factory=dict, description="Parameters of the fit flow's runs (`memplan fit`'s options), e.g. "
        "{model = \"gpt2-tiny\", max_overhead = 0.1}.")
    concurrency: int | None = Field(None, ge=1, description="At most this many runs of the class at once, on all "
                                    "its hosts (the work queue's concurrency limit); none: one per worker (`--limit 1`).")

    @field_validator("name")
    @classmethod
    def _queue_name(cls, name: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
            raise ValueError(f"name {name!r} must be letters, digits, '-', '_' or '.' (it names a work queue)")
        return name

    @field_validator("timezone")
    @classmethod
    def _timezone(cls, zone: str) -> str:
        from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

        try:
            ZoneInfo(zone)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"time zone {zone!r} is unknown; use an IANA name such as 'UTC' or 'Europe/Paris'") from None
        return zone

    @field_validator("profile_parameters", "plan_parameters", "fit_parameters")
    @classmethod
    def _parameters(cls, parameters: dict[str, Any], info) -> dict[str, Any]:
        allowed = {"profile_parameters": ("reuse",), "plan_parameters": ("refresh",),
                   "fit_parameters": FIT_PARAMETERS}[info.field_name]
        unknown = sorted(set(parameters) - set(allowed))
        if unknown:
            raise ValueError(f"unknown flow parameter(s) {unknown}; allowed: {', '.join(allowed)} (config_path "
                             f"is set by `memplan deploy`)")
        return parameters

    @property
    def device_key(self) -> str:
        return self.device or self.name

    def max_age_s(self, now=None) -> float:
        """The longest time between two scheduled profile runs (the next eight, in the class's timezone),
        the age at which a profile is late."""
        from datetime import datetime, timezone
        from zoneinfo import ZoneInfo

        from cronsim import CronSim

        runs = CronSim(self.profile_cron, (now or datetime.now(timezone.utc)).astimezone(ZoneInfo(self.timezone)))
        times = [next(runs) for _ in range(8)]
        return max((b - a).total_seconds() for a, b in zip(times, times[1:]))


class DeployConfig(Section):
    """Prefect deployments of the `profile`, `plan` and `fit` flows on a fleet (`memplan deploy`, docs/fleet.md)."""

    work_pool: str = Field("memplan", description="The process work pool the fleet's workers poll.")
    directory: str | None = Field(None, description="The project folder on every worker host (holding this "
                                  "pipeline.toml); default: this file's folder, so hosts share it (e.g. an NFS mount).")
    classes: list[DeviceClassConfig] = Field(description="The GPU classes ([[deploy.classes]] tables), one work queue each.")
    heartbeat_s: int = Field(60, ge=30, description="Seconds between a run's heartbeats (Prefect's minimum is 30).")
    zombie_after_s: int = Field(180, ge=40, description="A run without a heartbeat for this long is marked crashed "
                                "(its host died) by a Prefect automation, and re-run when `rerun_zombies`.")
    rerun_zombies: bool = Field(True, description="Re-run a crashed zombie's deployment (on a surviving host).")
    flow_retries: int = Field(0, ge=0, description="Prefect retries of a failed run, in the same process.")
    result_storage: str | None = Field(None, description="A Prefect storage block ('<block-type>/<name>', e.g. "
                                       "'s3-bucket/memplan-results') for the runs' results; none: <cache_dir>/prefect "
                                       "in the shared project folder.")
    notify_block: str | None = Field(None, description="A Prefect notification block ('<block-type>/<name>', e.g. "
                                     "'slack-webhook/ml-alerts') told of every failed or crashed run.")

    @model_validator(mode="after")
    def _distinct(self) -> DeployConfig:
        if self.zombie_after_s <= self.heartbeat_s:
            raise ValueError(f"zombie_after_s = {self.zombie_after_s} must exceed heartbeat_s = {self.heartbeat_s} "
                             f"(use about three heartbeats), or every run is taken for a zombie")
        names = [c.name for c in self.classes]
        if not names:
            raise ValueError("'classes' is empty; declare at least one [[deploy.classes]] table")
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"device class {duplicates[0]!r} is declared twice; class names must be unique")
        return self
