"""`memplan profile [pipeline.toml]`: trace and profile every model (the `profile` flow)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    @app.command()
    def profile(
        config: Annotated[Path, typer.Argument(help="The pipeline file (schema: docs/config.md).")] = Path("pipeline.toml"),
        reuse: Annotated[bool, typer.Option(help="Keep a cached profile of an unchanged graph instead of measuring again.")] = False,
    ) -> None:
        """Measure every operator of every model in pipeline.toml into the profile store."""
        from memplan.flows.console import console, exit_on_error, prepare

        prepare(config)
        with exit_on_error():
            from rich.table import Table

            from memplan.flows.profile import run_profile
            from memplan.flows.progress import stage_progress
            from memplan.tasks.config import load_config

            loaded = load_config(config)
            with stage_progress(2 * len(loaded.model_batches()), "starting Prefect"):
                runs = run_profile(config, reuse, loaded)
            table = Table("model", "batch", "nodes", "device", "run id", "file", title=f"profile runs in {loaded.store}")
            for run in runs:
                table.add_row(run["model"], str(run["batch_size"]), str(run["nodes"]), run["device"], run["run_id"],
                              run["path"])
            console().print(table)
