"""`memplan query "SELECT ..."`: read-only SQL over the profile store's DuckDB views.

Also the shared output of query-like commands (`emit`): a rich table, CSV, JSON or a Parquet file.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import sys
import warnings
from contextlib import contextmanager
from decimal import Decimal
from enum import Enum
from pathlib import Path
from typing import Annotated, Iterator, Optional

import typer

from memplan.flows.locations import ConfigOption, locate


class Format(str, Enum):
    table = "table"
    csv = "csv"
    json = "json"
    parquet = "parquet"


FormatOption = Annotated[Format, typer.Option("--format", "-f", help="Output: table (rich), csv, json or parquet.")]
OutputOption = Annotated[Optional[Path], typer.Option(
    "--output", "-o", help="Write to this file instead of stdout (required for parquet); written atomically.")]
PlansOption = Annotated[Optional[Path], typer.Option(
    "--plans", help="Folder of published plans; its index/*.parquet is the view `plans` "
                    "\\[default: publish.dir of ./pipeline.toml, else ./plans].", show_default=False)]
StoreOption = Annotated[Optional[str], typer.Option(
    "--store", help="Profile store folder or URL (s3://bucket/prefix) \\[default: store of ./pipeline.toml, "
                    "else $MEMPLAN_PROFILES_DB, else ./profiles_db].", show_default=False)]


def _err(message: str) -> None:
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True, soft_wrap=True).print(escape(message), style="red")


@contextmanager
def reporting_store_warnings() -> Iterator[None]:
    """Print the warnings about skipped files (profile store, plans index) on stderr, one line each."""
    from memplan.tasks.publish import PlansIndexWarning
    from memplan.tasks.store.profiles import ProfileStoreWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ProfileStoreWarning)
        warnings.simplefilter("always", PlansIndexWarning)
        try:
            yield
        finally:
            for w in caught:
                _err(f"warning: {w.message}")


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, (list, dict)):
        return json.dumps(value, default=str)
    return str(value)


def _json_number(value):
    """JSON has no NaN or infinity: such a float is written as null (strict parsers refuse `NaN`)."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _json_value(value):
    """JSON for what json cannot encode: SUM over integers is a DuckDB HUGEINT (a Decimal here)."""
    if isinstance(value, Decimal):
        return int(value) if value == value.to_integral_value() else float(value)
    return str(value)


def _write_atomic(path: Path, write) -> None:
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(temp)
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)


def check_output(fmt: Format, output: Path | None) -> None:
    """Refuse format/output combinations before any work is done."""
    if fmt is Format.parquet and output is None:
        raise typer.BadParameter("--format parquet needs --output FILE (Parquet is binary).")
    if fmt is Format.table and output is not None:
        raise typer.BadParameter("--output writes csv, json or parquet; choose one with --format.")
    if output is not None and (output.is_dir() or not output.parent.is_dir()):
        why = "is a folder; give a file name inside it" if output.is_dir() else \
            f"is in folder {output.parent}, which does not exist; create it or write elsewhere"
        _err(f"error: --output {output} {why}.")
        raise typer.Exit(1)


def emit(table, fmt: Format, output: Path | None = None, title: str | None = None) -> None:
    """Print or write the arrow `table` in format `fmt`."""
    check_output(fmt, output)
    if fmt is Format.parquet:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            _write_atomic(output, lambda p: pq.write_table(table, p))
        except pa.ArrowNotImplementedError as exc:
            _err(f"error: the result cannot be written as Parquet ({exc}); cast that column in the SELECT "
                 f"(e.g. CAST(x AS VARCHAR)) or write csv or json.")
            raise typer.Exit(1) from None
        return
    rows = list(zip(*(column.to_pylist() for column in table.columns)))
    if fmt is Format.table:
        from rich.table import Table
        from rich.text import Text

        from memplan.flows.console import console

        view = Table(title=None if title is None else Text(title))
        for name in table.column_names:            # data is Text, never markup: "[red]" prints as typed
            view.add_column(Text(name))
        for row in rows:
            view.add_row(*(Text(_cell(v)) for v in row))
        console().print(view)
        return
    if fmt is Format.json:
        records = [{name: _json_number(v) for name, v in zip(table.column_names, row)} for row in rows]
        text = json.dumps(records, default=_json_value, indent=1, allow_nan=False) + "\n"
    else:
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(table.column_names)
        writer.writerows([_cell(v) for v in row] for row in rows)
        text = buffer.getvalue()
    if output is None:
        sys.stdout.write(text)
    else:
        _write_atomic(output, lambda p: p.write_text(text))


def register(app: typer.Typer) -> None:
    @app.command("query")
    def query(
        sql: Annotated[str, typer.Argument(help="One SELECT (or SHOW/DESCRIBE/SUMMARIZE/EXPLAIN) statement over "
                                                "the views profiles, runs, latest_runs, latest_costs, plans.")],
        fmt: FormatOption = Format.table,
        output: OutputOption = None,
        store: StoreOption = None,
        plans: PlansOption = None,
        config: ConfigOption = None,
    ) -> None:
        """Query the profile store and the plans index with SQL (DuckDB, read-only).

        Views: profiles, runs, latest_runs, latest_costs (docs/profile-schema.md) and plans (the index of
        published plans).
        """
        import duckdb

        from memplan.flows.console import exit_on_error
        from memplan.tasks.config import MemplanError
        from memplan.tasks.publish import INDEX_SCHEMA, index_files
        from memplan.tasks.store.query import query as run_query

        check_output(fmt, output)
        with exit_on_error():
            where = locate(config, store, plans)
        where.say()
        try:
            with reporting_store_warnings():
                index = index_files(where.plans)
                table = run_query(sql, where.store, {"plans": (index, INDEX_SCHEMA)})
        except duckdb.Error as exc:
            _err(f"DuckDB: {exc}")
            raise typer.Exit(1)
        except (PermissionError, ValueError, MemplanError) as exc:
            _err(str(exc))
            raise typer.Exit(1)
        emit(table, fmt, output)
