"""`memplan validate PLAN`: run a plan against eager PyTorch (loss, gradients, peak, time)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

PlanArgument = Annotated[Path, typer.Argument(help="A plan JSON file.")]
ConfigOption = Annotated[Path, typer.Option("--config", help="The pipeline file declaring the plan's model.")]
ModelOption = Annotated[Optional[str], typer.Option(help="The plan's model (its name in the pipeline file).")]
BatchOption = Annotated[Optional[int], typer.Option(help="The plan's batch size.")]


def register(app: typer.Typer) -> None:
    @app.command()
    def validate(plan: PlanArgument, config: ConfigOption = Path("pipeline.toml"), model: ModelOption = None,
                 batch: BatchOption = None) -> None:
        """Check a plan: same loss, gradients and buffers as eager PyTorch, measured peak within budget."""
        from flows.console import console, exit_on_error, prepare

        prepare(config)
        with exit_on_error():
            validation, _, _ = run_validation(plan, config, model, batch)
            console().print(validation_table(validation))
            if not validation.passed:
                from tasks.validate import ValidationFailed

                raise ValidationFailed(validation.explain(str(plan)))


def run_validation(plan_path: Path, config_path: Path, model: str | None, batch: int | None):
    """Load the plan and the pipeline file, find the plan's model, measure eager PyTorch's step as the
    reference (its tensors in a temporary folder) and validate on the configured device; returns the
    `Validated` record, the model entry and the batch size."""
    from rich.status import Status

    from flows.lookup import model_for_plan
    from runtime.plan import Plan
    from tasks.config import load_config
    from tasks.memory_limit import memory_limit
    from tasks.models import resolve_device
    from tasks.validate import validate_alone

    plan = Plan.load(plan_path)
    config = load_config(config_path)
    device = resolve_device(config.device)
    spec, batch_size = model_for_plan(config, plan, model, batch)
    with Status(f"validating {plan_path.name} ({spec.name}, batch {batch_size}) on {device}"):
        return (validate_alone(plan, spec, batch_size, device, config.seed, config.validation,
                               limit=memory_limit(config, device)), spec, batch_size)


def validation_table(validation):
    """A validation as a rich table of measured against expected numbers."""
    from rich.table import Table

    from flows.report import overhead_text

    mib = 2**20
    table = Table("check", "plan", "reference", title=f"validation on {validation.device} ({validation.device_name})")
    table.add_row("loss", f"{validation.loss:.6g}", f"{validation.eager_loss:.6g} ({validation.reference})")
    table.add_row("tensors compared", str(validation.tensors_compared), f"max |diff| {validation.max_abs_error:.3g}")
    table.add_row("peak MiB", f"{validation.measured_peak_bytes / mib:.2f}",
                  f"budget {validation.budget_bytes / mib:.2f}, predicted {validation.predicted_peak_bytes / mib:.2f}, "
                  f"eager {validation.eager_peak_bytes / mib:.2f}")
    rounds = "" if validation.timed_steps is None else f", {validation.timed_steps} steps each"
    overhead = overhead_text(validation.overhead, validation.overhead_interval)
    table.add_row("step ms", f"{validation.measured_step_ms:.2f}",
                  f"eager {validation.eager_step_ms:.2f} (overhead {overhead}{rounds})")
    table.add_row("result", "[green]passed[/green]" if validation.passed else "[red]failed[/red]",
                  "; ".join(validation.reasons))
    return table
