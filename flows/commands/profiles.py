"""`memplan profiles list`: the profiling runs in the profile store."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from memplan.flows.locations import ConfigOption, locate
from memplan.flows.commands.query import Format, FormatOption, OutputOption, StoreOption, check_output, emit, reporting_store_warnings

LIST_SQL = """
SELECT run_id, device, model, strftime(created_at, '%Y-%m-%d %H:%M:%S') AS created_at, rows, complete,
       left(fingerprint, 12) AS fingerprint
FROM runs
WHERE (? IS NULL OR device = ? OR device_type = ?) AND (? IS NULL OR model = ?)
  AND (? IS NULL OR starts_with(fingerprint, ?))
ORDER BY created_at DESC, run_id DESC
"""


def register(app: typer.Typer) -> None:
    profiles = typer.Typer(help="Profiling runs in the profile store.", no_args_is_help=True)

    @profiles.command("list")
    def list_runs(
        device: Annotated[Optional[str], typer.Option(help="Only this device key (e.g. cpu) or type (cuda).")] = None,
        model: Annotated[Optional[str], typer.Option(help="Only this model.")] = None,
        fingerprint: Annotated[Optional[str], typer.Option(help="Only graphs whose fingerprint starts so.")] = None,
        fmt: FormatOption = Format.table,
        output: OutputOption = None,
        store: StoreOption = None,
        config: ConfigOption = None,
    ) -> None:
        """Show the runs (device, model, when, rows, completeness), newest first."""
        from memplan.flows.console import exit_on_error
        from memplan.tasks.store.query import connect

        check_output(fmt, output)
        with exit_on_error():
            where = locate(config, store)
        where.say(plans=False)
        with reporting_store_warnings():
            con = connect(where.store)
        device_type = device.split(":")[0] if device else None
        params = [device, device, device_type, model, model, fingerprint, fingerprint]
        table = con.sql(LIST_SQL, params=params).to_arrow_table()
        emit(table, fmt, output, title=f"Profiling runs in {where.store}")

    app.add_typer(profiles, name="profiles")
