"""`memplan publish PLAN`: validate a plan and, when it passes, publish it into plans/."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from memplan.flows.commands.validate import BatchOption, ConfigOption, ModelOption, PlanArgument


def register(app: typer.Typer) -> None:
    @app.command()
    def publish(
        plan: PlanArgument,
        config: ConfigOption = Path("pipeline.toml"),
        model: ModelOption = None,
        batch: BatchOption = None,
        alias: Annotated[Optional[str], typer.Option(help="Readable name \\[default: <model>-b<batch>-<solver>-<budget>B].")] = None,
    ) -> None:
        """Validate a plan on the configured device and publish it if it passes (idempotent)."""
        from memplan.flows.console import console, exit_on_error, prepare

        prepare(config)
        with exit_on_error():
            from memplan.flows.commands.validate import run_validation, validation_table
            from memplan.runtime.format.plan import Plan
            from memplan.tasks.config import load_config
            from memplan.tasks.publish import check_alias
            from memplan.tasks.publish import publish as publish_plan

            if alias is not None:
                check_alias(alias)                       # before the validation's minutes of work
            done = run_validation(plan, config, model, batch)
            validation, spec, batch_size = done.validation, done.spec, done.batch_size
            console().print(validation_table(done))
            loaded = Plan.load(plan)
            budget = f"{loaded.provenance.get('budget_bytes')}B"
            name = alias or f"{spec.name}-b{batch_size}-{loaded.provenance.get('solver')}-{budget}"
            plans_dir = load_config(config).publish.dir
            done = publish_plan(loaded, validation, plans_dir, alias=name, model=spec.name, batch_size=batch_size,
                                budget=budget)
            verb = "published" if done.changed else "already published, nothing changed:"
            console().print(f"{verb} {done.path} (alias {done.alias_path})")
