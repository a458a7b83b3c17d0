"""`memplan trace [pipeline.toml]`: capture the operator graphs of the models in pipeline.toml."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer


def register(app: typer.Typer) -> None:
    @app.command()
    def trace(
        config: Annotated[Path, typer.Argument(help="The pipeline file (schema: docs/config.md).")] = Path("pipeline.toml"),
        model: Annotated[Optional[str], typer.Option(help="Only this model (its name in pipeline.toml).")] = None,
        batch: Annotated[Optional[int], typer.Option(help="Only this batch size.")] = None,
    ) -> None:
        """Capture each (model, batch size) as an operator graph JSON under cache_dir/graphs."""
        from memplan.flows.console import console, exit_on_error, prepare

        prepare(config)
        with exit_on_error():
            from rich.progress import Progress
            from rich.table import Table

            from memplan.tasks.config import ConfigError, load_config
            from memplan.tasks.models import resolve_device
            from memplan.tasks.trace import trace as trace_model

            loaded = load_config(config)
            device = resolve_device(loaded.device)
            cells = loaded.model_batches(model, batch)
            if not cells:
                names = ", ".join(f"{m.name} (batch {m.batch_sizes})" for m in loaded.models)
                raise ConfigError(f"{config} declares no model {model or ''} at batch {batch or 'any'}; it declares {names}.")
            table = Table("model", "batch", "nodes", "values", "constant MiB", "fingerprint", "graph",
                          title=f"operator graphs on {device}")
            with Progress(console=console(), transient=True) as progress:
                bar = progress.add_task("tracing", total=len(cells))
                for spec, size in cells:
                    progress.update(bar, description=f"tracing {spec.name} b{size}")
                    traced, _ = trace_model(spec, size, device, loaded.seed, loaded.cache_dir)
                    table.add_row(spec.name, str(size), str(traced.nodes), str(traced.values),
                                  f"{traced.constant_bytes / 2**20:.1f}", traced.fingerprint[:16], traced.path)
                    progress.advance(bar)
            console().print(table)
