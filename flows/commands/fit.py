"""`memplan fit [pipeline.toml]`: the largest batch size (or sequence length) that fits the device memory limit
(the `fit` flow)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

ConfigArgument = Annotated[Path, typer.Argument(help="The pipeline file (schema: docs/config.md).")]


def register(app: typer.Typer) -> None:
    @app.command()
    def fit(
        config: ConfigArgument = Path("pipeline.toml"),
        model: Annotated[Optional[str], typer.Option(help="The model (its name in the pipeline file); needed "
                                                     "when it declares several.")] = None,
        max_overhead: Annotated[float, typer.Option(help="Predicted step-time overhead allowed over eager "
                                                    "(0.10: 10% slower).")] = 0.10,
        solver: Annotated[str, typer.Option(help="The solver of memplan's schedules (a fast one: dtr, ap-greedy, "
                                            "acg).")] = "dtr",
        device_memory: Annotated[Optional[str], typer.Option(help="The device memory limit, overriding the file's "
                                                             "device_memory: '16 GiB', bytes, or 'device'.")] = None,
        sequence: Annotated[bool, typer.Option("--sequence", help="Search the sequence length (the first per-sample "
                                               "dimension of the integer inputs) at --batch instead.")] = False,
        batch: Annotated[Optional[int], typer.Option(help="The batch size of a --sequence search \\[default: the "
                                                     "model's first batch size].", show_default=False)] = None,
        max_size: Annotated[int, typer.Option(help="The largest batch size (or sequence length) tried.")] = 4096,
        debug: Annotated[bool, typer.Option(help="Show Prefect's logs and tracebacks.")] = False,
    ) -> None:
        """The largest batch (or --sequence length) that fits the device memory limit: eager PyTorch, per-block
        checkpointing, and memplan within --max-overhead (validated). docs/fit.md."""
        from memplan.flows.console import console, exit_on_error, prepare

        prepare(config, debug)                    # before anything imports Prefect: it reads its settings then
        with exit_on_error():
            from memplan.flows.fit import run_fit, size_name

            answer = run_fit(config, model, max_overhead, solver, max_size, device_memory,
                             "sequence" if sequence else "batch", batch)
            console().print(fit_table(answer))
            search = answer.search
            console().print(
                f"largest {size_name(search)} in {search.limit_bytes / 2**20:.2f} MiB: eager {search.eager_largest}, "
                f"per-block checkpoint {search.checkpoint_largest}, memplan {search.memplan_largest} ({answer.verdict}); "
                f"plan {answer.plan_path or search.point(search.memplan_largest).plan_path}; plot {answer.plot}",
                markup=False, highlight=False)
            if answer.walk:
                console().print(f"measured walk: {answer.walk}", markup=False, highlight=False)
            if not answer.validated:
                raise typer.Exit(1)


def fit_table(answer):
    """The sizes evaluated as a rich table: predicted peaks (resident included), overhead, what fits."""
    from rich.table import Table

    from memplan.flows.fit import fit_rows, measured_text, size_name

    search = answer.search
    table = Table(size_name(search), "eager peak MiB", "per-block checkpoint peak MiB", "memplan peak MiB",
                  "overhead (predicted)", "measured", "fits?",
                  title=f"memplan fit: {search.model} in {search.limit_bytes / 2**20:.2f} MiB "
                        f"({search.optimizer}; peaks include parameters, gradients, optimizer state, batch)")
    for row in fit_rows(search):
        def mib(kind: str) -> str:
            return "-" if row[kind] is None else f"{row[kind] / 2**20:.2f}"

        overhead = "-" if row["overhead"] is None else f"{row['overhead']:+.1%}"
        table.add_row(str(row["size"]), mib("eager"), mib("checkpoint"), mib("memplan"), overhead,
                      measured_text(answer, row["size"]), ", ".join(sorted(row["fits"])) or "[red]none[/red]")
    return table
