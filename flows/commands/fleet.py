"""`memplan fleet status [pipeline.toml]`: per device class of `[deploy]` and model of `[[models]]`, the
newest complete profile run in the store and its age; a (class, model) is `late` when that age exceeds the
longest gap of the class's profile cron schedule, `missing` when the store holds no complete run of that
model on the class's device key. Exits with status 1 when any is late or missing (cron, CI alerts)."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from memplan.flows.commands.query import Format, FormatOption, OutputOption, StoreOption, check_output, emit, reporting_store_warnings

NEWEST_SQL = """
SELECT device, model, run_id, host, created_at FROM runs WHERE complete
QUALIFY row_number() OVER (PARTITION BY device, model ORDER BY created_at DESC, run_id DESC) = 1
"""


def fleet_status(config, store: str | None = None, now: datetime | None = None) -> list[dict[str, Any]]:
    """One row per (device class of `config.deploy`, model of `config.models`): class, device key, model,
    newest complete run (id, host, time), its age and the allowed age in seconds, and status
    ok | late | missing."""
    from memplan.tasks.store.query import connect

    now = now or datetime.now(timezone.utc)
    newest = {row[:2]: row[2:] for row in connect(store or config.store).execute(NEWEST_SQL).fetchall()}
    rows = []
    for cls in config.deploy.classes:
        allowed = cls.max_age_s(now)
        for model in config.models:
            run_id, host, created = newest.get((cls.device_key, model.name), (None, None, None))
            age = None if created is None else (now - created).total_seconds()
            status = "missing" if age is None else "late" if age > allowed else "ok"
            rows.append(dict(device_class=cls.name, device=cls.device_key, model=model.name, status=status,
                             newest_run=run_id, host=host, profiled_at=None if created is None else created.isoformat(),
                             age_s=None if age is None else round(age, 1), allowed_age_s=allowed,
                             schedule=f"{cls.profile_cron} ({cls.timezone})"))
    return rows


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"


def register(app: typer.Typer) -> None:
    fleet = typer.Typer(help="The device classes of a fleet (\\[deploy] in pipeline.toml).", no_args_is_help=True)

    @fleet.command("status")
    def status(
        config: Annotated[Path, typer.Argument(help="The pipeline file with a \\[deploy] section.")] = Path("pipeline.toml"),
        fmt: FormatOption = Format.table,
        output: OutputOption = None,
        store: StoreOption = None,
        strict: Annotated[bool, typer.Option(help="Exit with status 1 when any (class, model) is late or missing; "
                                                  "--no-strict: always 0 (only the table).")] = True,
    ) -> None:
        """Per device class and model: the newest profile run, its age, late or missing (exit status 1)."""
        import pyarrow as pa

        from memplan.flows.console import exit_on_error

        check_output(fmt, output)
        with exit_on_error():
            from memplan.tasks.config import ConfigError, load_config

            loaded = load_config(config)
            if loaded.deploy is None:
                raise ConfigError(f"{config} has no [deploy] section, so it declares no device classes "
                                  f"(docs/config.md, docs/fleet.md).")
            with reporting_store_warnings():
                rows = fleet_status(loaded, store)
        if fmt is Format.table:
            shown = [dict(device_class=r["device_class"], device=r["device"], model=r["model"], status=r["status"],
                          newest_run=r["newest_run"], host=r["host"], profiled_at=r["profiled_at"],
                          age=_age(r["age_s"]), allowed=_age(r["allowed_age_s"]), schedule=r["schedule"])
                     for r in rows]
            emit(pa.Table.from_pylist(shown), fmt, title=f"fleet status ({store or loaded.store})")
        else:
            emit(pa.Table.from_pylist(rows), fmt, output)
        if strict and any(r["status"] != "ok" for r in rows):
            raise typer.Exit(1)

    def pausing(paused: bool):
        def command(
            config: Annotated[Path, typer.Argument(help="The pipeline file with a \\[deploy] section.")] = Path("pipeline.toml"),
            classes: Annotated[Optional[list[str]], typer.Option("--class", help="Only this device class (repeatable).")] = None,
            debug: Annotated[bool, typer.Option(help="Show the traceback of a failure.")] = False,
        ) -> None:
            from rich.table import Table

            from memplan.flows.console import console, exit_on_error
            from memplan.flows.pause import set_paused
            from memplan.tasks.config import ConfigError, load_config

            with exit_on_error(debug):
                loaded = load_config(config)
                if loaded.deploy is None:
                    raise ConfigError(f"{config} has no [deploy] section, so it declares no deployments.")
                table = Table("deployment", "status")
                for name, status in set_paused(loaded.deploy, paused, classes):
                    table.add_row(name, status)
            console().print(table)

        command.__doc__ = ("Pause the profile, plan and fit deployments: their schedules create no new runs and their "
                           "scheduled and late runs are cancelled (a running one finishes)." if paused else
                           "Resume paused deployments: their schedules run again.")
        return command

    fleet.command("pause")(pausing(True))
    fleet.command("resume")(pausing(False))
    app.add_typer(fleet, name="fleet")
