"""What a pipeline run reports: one `Outcome` per matrix cell, a markdown table of them, and a
memory-vs-overhead plot per model (PNG), both left as Prefect artifacts."""

from __future__ import annotations

import base64
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from memplan.tasks.config import Case
from memplan.tasks.records import Published, Solved, StageError, Validated
from memplan.tasks.solve.core.optimizer import OPTIMIZERS

MIB = 2**20


@dataclass(frozen=True)
class Outcome:
    """The fate of one matrix cell. `status`: published, infeasible (no schedule within the budget on this
    device; `least_feasible_bytes` is the least budget the run knows is feasible), rejected (failed
    validation) or failed (a stage raised `error`, the error's type, in the stage `failed_stage`); `message` says
    why for the last three, and for a published `max_overhead` cell what its measured
    walk validated (flows/refine.py), for a published compiled cell what its measured search measured
    (tasks/compiled/policy_cell.py). `overhead_vs_no_recompute`: the measured overhead the limit is about, against the
    no-recomputation plan timed in the same rounds. `arena_peak_bytes`: the measured peak in arena mode,
    for plans with addresses; `compiled_peak_bytes`: under torch.compile, for policy plans solved compiled.
    `reference`: the step validation compared the plan with (eager, or where eager does not fit `device_memory`
    the first that does, down to the host's: tasks/fit/reference.py). `form`: how the plan runs, "executor"
    (`runtime.load`) or "policy" (`runtime.apply`, `LOADERS`)."""

    alias: str
    model: str
    batch_size: int
    solver: str
    budget: str
    status: str
    budget_bytes: int | None = None
    checkpoint_all_peak_bytes: int | None = None
    predicted_peak_bytes: int | None = None
    measured_peak_bytes: int | None = None
    eager_peak_bytes: int | None = None
    predicted_overhead: float | None = None
    overhead: float | None = None
    overhead_interval: list[float] | None = None
    overhead_vs_no_recompute: float | None = None
    overhead_vs_no_recompute_interval: list[float] | None = None
    arena_peak_bytes: int | None = None
    compiled_peak_bytes: int | None = None
    plan_id: str | None = None
    least_feasible_bytes: int | None = None
    reference: str | None = None
    message: str = ""
    form: str = "executor"
    failed_stage: str | None = None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def failed(cls, case: Case, error: StageError, solved: Solved | None = None) -> Outcome:
        """The outcome of a cell a stage raised `error` for, with what its solve found where it ran (`solved`)."""
        found = {} if solved is None else dict(budget_bytes=solved.budget_bytes,
                                               checkpoint_all_peak_bytes=solved.checkpoint_all_peak_bytes,
                                               predicted_peak_bytes=solved.predicted_peak_bytes)
        return cls(alias=case.alias, model=case.model.name, batch_size=case.batch_size, solver=case.plan.solver,
                   form=case.plan.plan_form, budget=case.budget.label, status="failed", **found,
                   message=error.explain(case.alias), failed_stage=error.stage, error=error.error)

    @classmethod
    def of(cls, case: Case, solved: Solved, validated: Validated | None = None, published: Published | None = None,
           message: str = "", least_feasible_bytes: int | None = None, eager_peak_bytes: int | None = None) -> Outcome:
        """The outcome of a cell from its stage records: infeasible without a schedule (`least_feasible_bytes`:
        the least budget the run knows fits, else the solve's own probe; `eager_peak_bytes`: eager PyTorch's
        measured peak, from the cell's reference), rejected when validation failed, published with the
        `Published` record."""
        common = dict(alias=case.alias, model=case.model.name, batch_size=case.batch_size, solver=case.plan.solver,
                      form=case.plan.plan_form, budget=case.budget.label, budget_bytes=solved.budget_bytes,
                      checkpoint_all_peak_bytes=solved.checkpoint_all_peak_bytes,
                      predicted_peak_bytes=solved.predicted_peak_bytes, message=message)
        if validated is None:
            known = least_feasible_bytes or solved.smallest_feasible_budget or solved.checkpoint_all_peak_bytes
            return cls(**common, status="infeasible", least_feasible_bytes=known, eager_peak_bytes=eager_peak_bytes)
        measured = dict(measured_peak_bytes=validated.measured_peak_bytes, eager_peak_bytes=validated.eager_peak_bytes,
                        overhead=validated.overhead, overhead_interval=validated.overhead_interval,
                        overhead_vs_no_recompute=validated.overhead_vs_no_recompute,
                        overhead_vs_no_recompute_interval=validated.overhead_vs_no_recompute_interval,
                        arena_peak_bytes=validated.arena_peak_bytes, reference=validated.reference,
                        compiled_peak_bytes=validated.compiled_peak_bytes,
                        predicted_overhead=None if solved.objective is None
                        else solved.objective / solved.checkpoint_all_cost - 1)
        if published is None:
            return cls(**common, **measured, status="rejected")
        return cls(**common, **measured, status="published", plan_id=published.plan_id)


LOADERS = {"executor": "memplan.load(plan, model, loss_fn)", "policy": "memplan.apply(plan, model, loss_fn, batch)",
           "compiled": "memplan.load(plan, model, loss_fn)"}
"""How a training job runs a plan of each form (docs/training.md); a compiled-form plan's step is compiled by
inductor at its first call."""


def run_with(form: str | None, optimizer: str | None) -> str:
    """How a training job runs a plan of `form` (None: the executor's) that runs `optimizer` (a name in
    `tasks.solve.core.optimizer.OPTIMIZERS`) inside the step, or none."""
    call = LOADERS.get(form or "executor", LOADERS["executor"])
    if optimizer is None:
        return call
    known = OPTIMIZERS.get(optimizer)
    name = f"torch.optim.{known.torch_class}" if known else f"{optimizer!r} optimizer"
    return f"{call[:-1]}, optimizer=opt), opt a {name} over model.parameters()"


def loading_hint(forms: set[str]) -> str:
    """One line saying how to run the plans of `forms`, e.g. after a run's table."""
    return "; ".join(f"{form} plans, {LOADERS[form]}" + (" in your own loop, then loss.backward() (docs/training.md)"
                                                         if form == "policy" else "")
                     for form in LOADERS if form in forms)


def _mib(nbytes: int | None) -> str:
    return "" if nbytes is None else f"{nbytes / MIB:.1f}"


def _pct(x: float | None) -> str:
    return "" if x is None else f"{x:+.0%}"


def budget_text(outcome: Outcome) -> str:
    """A cell's budget in MiB with its fraction of eager PyTorch's measured peak, e.g. '36.4 (50% of eager)'."""
    text = _mib(outcome.budget_bytes)
    if outcome.budget_bytes is not None and outcome.eager_peak_bytes:
        text += f" ({outcome.budget_bytes / outcome.eager_peak_bytes:.0%} of eager)"
    return text


NOISE_LIMIT = 0.25
"""Widest half of a 95% interval at which a measured overhead is printed as a number (25 points)."""


def overhead_text(overhead: float | None, interval: list[float] | None = None) -> str:
    """A measured overhead with the larger half X of its 95% interval, e.g. '+11% ±3%'; 'not measurable here
    (±X)' when X exceeds the overhead's own size or `NOISE_LIMIT` (the interval spans zero, or the host is
    too noisy for the figure to mean anything), and 'not measurable here (under 6 rounds)' without one."""
    if overhead is None:
        return ""
    if interval is None:
        return "not measurable here (under 6 rounds)"
    half = max(overhead - interval[0], interval[1] - overhead)
    if half > abs(overhead) or half > NOISE_LIMIT:
        return f"not measurable here (±{half:.0%})"
    return f"{overhead:+.0%} ±{half:.0%}"


def limit_verdict(overhead: float, interval: list[float] | None, limit: float) -> str:
    """Whether a measured overhead is within a `max_overhead` limit: by its median, as the measured walk judges
    (tasks/validate/overhead.py), saying where the 95% interval lies when it straddles the limit."""
    if overhead <= limit:
        verdict = f"within the limit ({overhead:+.1%} <= +{limit:.0%})"
        return verdict if interval is None or interval[1] <= limit else \
            f"{verdict}; its 95% interval reaches {interval[1]:+.1%}"
    verdict = f"OVER the limit ({overhead:+.1%} > +{limit:.0%})"
    if interval is None:
        return f"{verdict}; no interval (under 6 rounds)"
    return f"{verdict}, beyond its 95% interval" if interval[0] > limit else \
        f"{verdict}, though its 95% interval reaches down to {interval[0]:+.1%}"


def status_text(outcome: Outcome) -> str:
    """'published', or the status with the least feasible budget known for an infeasible cell, the stage and the
    error's type for a failed one."""
    if outcome.status == "infeasible" and outcome.least_feasible_bytes is not None:
        return f"infeasible here (feasible from {outcome.least_feasible_bytes / MIB:.1f} MiB)"
    if outcome.status == "failed":
        return f"failed in {outcome.failed_stage} ({outcome.error})"
    return outcome.status


def markdown_table(outcomes: list[Outcome]) -> str:
    """The plans of a run as a markdown table: form, budget (in MiB and as a fraction of eager's measured peak),
    predicted and measured peak, overhead, status (a failed cell's: its error, naming the stage)."""
    lines = [
        "| plan | solver | form | budget | budget MiB | predicted peak MiB | measured peak MiB | eager peak MiB "
        "| predicted overhead | measured overhead | vs no recompute | status |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for o in outcomes:
        status = o.message if o.status == "failed" else f"{status_text(o)}: {o.message}" if o.message else o.status
        lines.append(
            f"| {o.alias} | {o.solver} | {o.form} | {o.budget} | {budget_text(o)} | {_mib(o.predicted_peak_bytes)} "
            f"| {_mib(o.measured_peak_bytes)} | {_mib(o.eager_peak_bytes)} | {_pct(o.predicted_overhead)} "
            f"| {overhead_text(o.overhead, o.overhead_interval)} "
            f"| {overhead_text(o.overhead_vs_no_recompute, o.overhead_vs_no_recompute_interval)} "
            f"| {status.replace('|', '/')} |"
        )
    return "\n".join(lines) + "\n"


def memory_overhead_plot(outcomes: list[Outcome], model: str, path: str | Path) -> Path:
    """PNG of measured peak (MiB) against measured step-time overhead (a line across its 95% interval) for
    the validated plans of one model, one marker per solver, with eager PyTorch at zero overhead."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [o for o in outcomes if o.model == model and o.measured_peak_bytes is not None]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    eager = [o.eager_peak_bytes for o in rows if o.eager_peak_bytes is not None]
    if eager:
        ax.scatter([0.0], [max(eager) / MIB], marker="*", s=150, color="black", label="eager PyTorch")
    for solver in sorted({o.solver for o in rows}):
        mine = [o for o in rows if o.solver == solver]
        points = ax.scatter([100 * o.overhead for o in mine], [o.measured_peak_bytes / MIB for o in mine], label=solver)
        for o in mine:                                   # the overhead's 95% interval, where one was measured
            if o.overhead_interval is not None:
                ax.plot([100 * x for x in o.overhead_interval], [o.measured_peak_bytes / MIB] * 2,
                        color=points.get_facecolor()[0], alpha=0.5, linewidth=1)
        for o in mine:
            ax.annotate(o.budget, (100 * o.overhead, o.measured_peak_bytes / MIB), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("step-time overhead over eager (%)")
    ax.set_ylabel("measured peak (MiB)")
    ax.set_title(f"{model}: memory vs overhead")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    plt.close(fig)
    return path


def artifact_key(*parts: str) -> str:
    """A Prefect artifact key (lowercase letters, digits and dashes)."""
    return re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")


def create_artifacts(outcomes: list[Outcome], report_dir: str | Path) -> list[Path]:
    """A markdown artifact with the plans table and, per model, an image artifact of its plot (the PNG is
    also written under `report_dir`). Returns the PNG paths."""
    from prefect.artifacts import create_image_artifact, create_markdown_artifact

    hint = f"\nTo train with them: {loading_hint({o.form for o in outcomes})}.\n"
    create_markdown_artifact(markdown=markdown_table(outcomes) + hint, key="memplan-plans",
                             description="Plans of this run: budget, predicted and measured peak, overhead.")
    pngs = []
    for model in sorted({o.model for o in outcomes if o.measured_peak_bytes is not None}):
        png = memory_overhead_plot(outcomes, model, Path(report_dir) / f"{model}-memory-vs-overhead.png")
        data = base64.b64encode(png.read_bytes()).decode()
        create_image_artifact(image_url=f"data:image/png;base64,{data}", key=artifact_key("memplan", model, "plot"),
                              description=f"{model}: measured peak vs step-time overhead ({png})")
        pngs.append(png)
    return pngs
