"""`memplan plans list|show`: the published plans and their index."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from memplan.flows.commands.query import Format, FormatOption, OutputOption
from memplan.flows.locations import ConfigOption, locate

DirOption = Annotated[Optional[Path], typer.Option(
    "--plans", "--dir", help="Folder of published plans \\[default: publish.dir of ./pipeline.toml, else ./plans].",
    show_default=False)]


def _plans_dir(config: Path | None, plans_dir: Path | None) -> Path:
    where = locate(config, plans=plans_dir)
    where.say(store=False)
    return where.plans


def register(app: typer.Typer) -> None:
    plans = typer.Typer(help="Published plans (plans/ and its Parquet index).", no_args_is_help=True)

    @plans.command("list")
    def list_plans(
        plans_dir: DirOption = None,
        config: ConfigOption = None,
        model: Annotated[Optional[str], typer.Option(help="Only this model.")] = None,
        solver: Annotated[Optional[str], typer.Option(help="Only this solver.")] = None,
        device_class: Annotated[Optional[str], typer.Option(
            "--class", help="Only plans validated on this fleet device class (the name of a \\[\\[deploy.classes]] table).")] = None,
        batch_size: Annotated[Optional[int], typer.Option(help="Only this batch size.")] = None,
        limit: Annotated[Optional[int], typer.Option(min=1, help="At most this many (the newest).")] = None,
        fmt: FormatOption = Format.table,
        output: OutputOption = None,
    ) -> None:
        """One row per published plan, newest first (`--class h100 --model m --limit 1`: the plan a training
        job on that class loads); csv, json and parquet give every column of the plans index."""
        import pyarrow as pa

        from memplan.flows.commands.query import check_output, emit, reporting_store_warnings
        from memplan.flows.console import exit_on_error
        from memplan.tasks.publish import INDEX_SCHEMA, read_index

        check_output(fmt, output)
        with exit_on_error():
            plans_dir = _plans_dir(config, plans_dir)
        with exit_on_error(), reporting_store_warnings():
            rows = read_index(plans_dir, "(? IS NULL OR model = ?) AND (? IS NULL OR solver = ?) AND "
                              "(? IS NULL OR device_class = ?) AND (? IS NULL OR batch_size = ?)",
                              [model, model, solver, solver, device_class, device_class, batch_size, batch_size])
        rows = rows[:limit]
        if fmt is Format.table:
            _print_plans(rows, plans_dir)
        else:
            emit(pa.Table.from_pylist(rows, schema=INDEX_SCHEMA), fmt, output)

    @plans.command("show")
    def show(
        name: Annotated[str, typer.Argument(help="A plan id, an id prefix (8+ hex digits) or an alias.")],
        plans_dir: DirOption = None,
        config: ConfigOption = None,
    ) -> None:
        """A plan's provenance, predictions, schedule summary, index row and how a training job runs it."""
        from rich.table import Table

        from memplan.flows.commands.query import reporting_store_warnings
        from memplan.flows.console import console, exit_on_error
        from memplan.flows.report import run_with
        from memplan.runtime.format.plan import Plan
        from memplan.tasks.publish import plan_id, read_index, resolve

        with exit_on_error():
            plans_dir = _plans_dir(config, plans_dir)
        with exit_on_error(), reporting_store_warnings():
            path = resolve(plans_dir, name)
            plan = Plan.load(path)
            pid = plan_id(plan)
            rows = read_index(plans_dir, "plan_id = ?", [pid])
        computes = plan.compute_steps()
        table = Table("key", "value", title=f"plan {pid[:12]} ({path})", show_header=False)
        table.add_row("fingerprint", plan.fingerprint)
        table.add_row("run it with", run_with(plan.form, plan.provenance.get("optimizer_in_step")))
        table.add_row("schedule", f"{len(plan.schedule)} steps: {len(computes)} computes of {len(set(computes))} "
                                  f"nodes ({len(computes) - len(set(computes))} recomputations)")
        for key, value in (plan.predicted | plan.provenance).items():
            table.add_row(key, str(value))
        for key, value in (rows[0] if rows else {}).items():
            table.add_row(f"index.{key}", str(value))
        console().print(table)

    app.add_typer(plans, name="plans")


def _print_plans(rows: list[dict], plans_dir: Path) -> None:
    """The index rows as a table in MiB, and how a training job loads their plans."""
    from rich.table import Column, Table

    from memplan.flows.console import console
    from memplan.flows.report import loading_hint

    mib = 2**20
    width = max((len(r["alias"]) for r in rows), default=5)
    table = Table(Column("plan id", no_wrap=True), Column("alias", no_wrap=True, min_width=width), "solver", "form",
                  "budget MiB", "predicted MiB", "measured MiB", "eager MiB", "overhead", "vs no recompute", "device",
                  "class", "published",
                  title=f"plans in {plans_dir}")
    for r in rows:
        table.add_row(r["plan_id"][:12], r["alias"], r["solver"], r.get("form") or "executor",
                      f"{r['budget_bytes'] / mib:.1f}",
                      f"{r['predicted_peak_bytes'] / mib:.1f}", f"{r['measured_peak_bytes'] / mib:.1f}",
                      f"{r['eager_peak_bytes'] / mib:.1f}", f"{r['overhead']:+.0%}", limited_text(r), r["device"],
                      r.get("device_class") or "",
                      f"{r['published_at']:%Y-%m-%d %H:%M}")
    console().print(table)
    forms = {r.get("form") or "executor" for r in rows}
    if forms:
        console().print(f"To train with them: {loading_hint(forms)}.")


def limited_text(row: dict) -> str:
    """A `max_overhead` plan's measured overhead against its no-recomputation plan and its limit ("" for other
    plans; a policy-form plan, or one validated without that plan, is judged on `overhead`: "-")."""
    limit, measured = row.get("max_overhead"), row.get("overhead_vs_no_recompute")
    text = "-" if measured is None else f"{measured:+.0%}"
    return ("" if measured is None else text) if limit is None else f"{text} (limit +{limit:.0%})"
