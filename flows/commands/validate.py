"""`memplan validate PLAN`: run a plan against eager PyTorch (loss, gradients, peak, time)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

if TYPE_CHECKING:
    from memplan.runtime.format.graph import OpGraph
    from memplan.runtime.format.plan import Plan
    from memplan.tasks.config import ModelConfig
    from memplan.tasks.records import Validated

PlanArgument = Annotated[Path, typer.Argument(help="A plan JSON file.")]
ConfigOption = Annotated[Path, typer.Option("--config", help="The pipeline file declaring the plan's model.")]
ModelOption = Annotated[Optional[str], typer.Option(help="The plan's model (its name in the pipeline file).")]
BatchOption = Annotated[Optional[int], typer.Option(help="The plan's batch size.")]


def register(app: typer.Typer) -> None:
    @app.command()
    def validate(plan: PlanArgument, config: ConfigOption = Path("pipeline.toml"), model: ModelOption = None,
                 batch: BatchOption = None) -> None:
        """Check a plan: same loss, gradients and buffers as eager PyTorch, measured peak within budget."""
        from memplan.flows.console import console, exit_on_error, prepare

        prepare(config)
        with exit_on_error():
            done = run_validation(plan, config, model, batch)
            validation = done.validation
            console().print(validation_table(done))
            if not validation.passed:
                from memplan.tasks.validate.stage import ValidationFailed

                raise ValidationFailed(validation.explain(str(plan)))


@dataclass(frozen=True)
class CommandValidation:
    """What `memplan validate` found: the `validation`, the plan's model entry and batch size, and for a
    `max_overhead` plan its limit, what its overhead was measured against (`no_recompute_for`) and whether
    that overhead is the one the limit is about (`judged`: against its no-recomputation plan, or a policy-form
    plan's against eager)."""

    validation: Validated
    spec: ModelConfig
    batch_size: int
    max_overhead: float | None = None
    against: str = ""
    judged: bool = False


def run_validation(plan_path: Path, config_path: Path, model: str | None, batch: int | None) -> CommandValidation:
    """Load the plan and the pipeline file, find the plan's model, measure eager PyTorch's step as the
    reference (its tensors in a temporary folder) and validate on the configured device; a `max_overhead`
    plan is timed beside its no-recomputation plan (`no_recompute_for`), where there is one."""
    from rich.status import Status

    from memplan.flows.lookup import model_for_plan
    from memplan.runtime.format.plan import Plan
    from memplan.runtime.policy.form import FORM as POLICY
    from memplan.tasks.config import load_config
    from memplan.tasks.fit.memory_limit import memory_limit
    from memplan.tasks.models import resolve_device
    from memplan.tasks.validate.stage import validate_alone

    plan = Plan.load(plan_path)
    config = load_config(config_path)
    device = resolve_device(config.device)
    spec, batch_size = model_for_plan(config, plan, model, batch)
    limit, graph, baseline, against = plan.provenance.get("max_overhead"), None, None, ""
    with Status(f"validating {plan_path.name} ({spec.name}, batch {batch_size}) on {device}"):
        if limit is not None:
            graph, baseline, against = no_recompute_for(plan_path, plan, spec, batch_size, device, config.seed)
        validation = validate_alone(plan, spec, batch_size, device, config.seed, config.validation, graph=graph,
                                    limit=memory_limit(config, device), no_recompute=baseline)
    return CommandValidation(validation, spec, batch_size, limit, against, baseline is not None or plan.form == POLICY)


def no_recompute_for(plan_path: Path, plan: Plan, spec: ModelConfig, batch_size: int, device: str,
                     seed: int) -> tuple[OpGraph | None, Plan | None, str]:
    """(graph, no-recomputation plan, "against ..." or why there is none) for a `max_overhead` plan: the file the
    solve stage wrote beside it (`no_recompute_beside`); else, for an executor plan without the optimizer inside
    the step or DDP buckets, the eager-order plan (`runtime.format.plan.default_plan`: every node once, in order, as the
    executor runs the solve stage's no-recomputation plan) of its graph captured here with its rewrites, which
    validation then reuses. The others' no-recomputation step needs the solve stage's problem (its profile)."""
    from memplan.runtime.tracing.capture import capture
    from memplan.runtime.format.plan import default_plan
    from memplan.runtime.policy.form import FORM as POLICY
    from memplan.tasks.models import build_batch, build_loss, build_model
    from memplan.tasks.validate.overhead import no_recompute_beside

    baseline, why = no_recompute_beside(plan_path, plan)
    if baseline is not None:
        return None, baseline, f"against {why}"
    if plan.form == POLICY:
        return None, None, f"{why}: its limit is judged on the overhead against eager"
    if plan.provenance.get("optimizer_in_step") or plan.provenance.get("ddp_bucket_mb"):
        return None, None, (f"{why}; one for a plan with the optimizer inside the step or DDP buckets is built from the "
                            f"solve stage's profiled problem, not here, so only the overhead against eager is measured")
    graph = capture(build_model(spec, seed).to(device), build_loss(spec), build_batch(spec, batch_size, seed, device),
                    rewrites=plan.rewrites)
    return graph, default_plan(graph), f"against the eager-order plan of its graph, built here: {why}"


def validation_table(done: CommandValidation):
    """A validation as a rich table of measured against expected numbers; for a `max_overhead` plan also its
    overhead against the no-recomputation plan and the limit's verdict, or why it has none."""
    from rich.table import Table

    from memplan.flows.report import limit_verdict, overhead_text

    validation, mib = done.validation, 2**20
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
    if done.max_overhead is not None:
        timed = validation.overhead_vs_no_recompute is not None
        if timed:
            table.add_row("vs no recompute", overhead_text(validation.overhead_vs_no_recompute,
                                                           validation.overhead_vs_no_recompute_interval),
                          f"no-recomputation plan {validation.no_recompute_step_ms:.2f} ms ({done.against})")
        verdict = limit_verdict(validation.limited_overhead(), validation.limited_interval(), done.max_overhead)
        table.add_row("max_overhead", f"+{done.max_overhead:.0%}", f"not judged: {done.against}" if not done.judged
                      else verdict if timed else f"{verdict}; {done.against}")
    table.add_row("result", "[green]passed[/green]" if validation.passed else "[red]failed[/red]",
                  "; ".join(validation.reasons))
    return table
