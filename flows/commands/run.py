"""`memplan run [pipeline.toml]`: the whole pipeline (the `plan` flow) on Prefect's local server."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

ConfigArgument = Annotated[Path, typer.Argument(help="The pipeline file (schema: docs/config.md).")]


def register(app: typer.Typer) -> None:
    @app.command()
    def run(
        config: ConfigArgument = Path("pipeline.toml"),
        refresh: Annotated[bool, typer.Option(help="Re-run every stage instead of re-using cached results.")] = False,
        debug: Annotated[bool, typer.Option(help="Show Prefect's logs and tracebacks of failed stages.")] = False,
    ) -> None:
        """Trace, profile, solve, validate and publish every plan that pipeline.toml declares."""
        from memplan.flows.console import errors, exit_on_error, prepare
        from memplan.flows.interrupt import MESSAGE, stopping_cleanly

        prepare(config, debug)
        try:
            with exit_on_error():
                from memplan.tasks.config import load_config

                from memplan.flows.preflight import check_writable_folder

                loaded = load_config(config)
                check_writable_folder("cache_dir", loaded.cache_dir)       # where the run's stderr log goes
                with stopping_cleanly(Path(loaded.cache_dir) / "run-stderr.log"):
                    _run(config, refresh, loaded)
        except KeyboardInterrupt:            # before the handlers are in place (or in-process callers)
            errors().print(MESSAGE, markup=False, highlight=False)
            raise typer.Exit(130) from None


def _run(config: Path, refresh: bool, loaded) -> None:
    """Run the plan flow and print its outcome table."""
    from memplan.flows.console import console
    from memplan.flows.plan import PipelineFailed, run_plan
    from memplan.flows.progress import stage_progress
    from memplan.flows.report import loading_hint
    from memplan.tasks.config import expand_matrix, graph_forms

    cases = expand_matrix(loaded)
    graphs = sum(len(graph_forms(m.name, b, cases)) for m, b in loaded.model_batches())
    stages = 2 * graphs + 3 * len(cases)
    try:
        with stage_progress(stages, "starting Prefect"):
            outcomes = run_plan(config, refresh, loaded)
    except PipelineFailed as failed:
        console().print(outcome_table(failed.outcomes))
        raise
    console().print(outcome_table(outcomes))
    published = sum(o["status"] == "published" for o in outcomes)
    console().print(f"published {published} of {len(outcomes)} plans into {loaded.publish.dir}/"
                    + ("" if published == len(outcomes) else "; the others' budgets are infeasible on this device "
                       "(the table gives the least feasible budget known)"))
    forms = {o["form"] for o in outcomes if o["status"] == "published"}
    if forms:
        console().print(f"To train with them: {loading_hint(forms)}.")


def outcome_table(outcomes: list[dict[str, Any]]):
    """The outcomes of a run as a rich table."""
    from rich.table import Column, Table

    from memplan.flows.report import Outcome, overhead_text, status_text

    mib = 2**20
    width = max((len(o["alias"]) for o in outcomes), default=4)
    table = Table(Column("plan", no_wrap=True, min_width=width), "form", "budget MiB", "predicted peak MiB",
                  "measured peak MiB", "eager peak MiB", "overhead", "vs no recompute", "status",
                  title="memplan plans")
    for o in outcomes:
        def size(key: str) -> str:
            return "" if o[key] is None else f"{o[key] / mib:.1f}"

        overhead = overhead_text(o["overhead"], o.get("overhead_interval"))
        limited = overhead_text(o.get("overhead_vs_no_recompute"), o.get("overhead_vs_no_recompute_interval"))
        style = "green" if o["status"] == "published" else "red"
        table.add_row(o["alias"], o["form"], size("budget_bytes"), size("predicted_peak_bytes"),
                      size("measured_peak_bytes"), size("eager_peak_bytes"), overhead, limited,
                      f"[{style}]{status_text(Outcome(**o))}[/{style}]")
    return table
