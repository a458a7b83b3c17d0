"""The measured search of a compiled policy cell in the pipeline: a `[[plans]]` table with `options = { compiled =
true }` and a budget in bytes or as a fraction, whose model trains under torch.compile.

The simulator models eager autograd; compiled, AOTAutograd's partitioner decides what the graphs keep, so a plan
solved at the budget may peak above it compiled, or far below it and recompute more than it needs
(tasks/compiled/policy_search.py). After the solve stage, `search_cell` runs `tasks.compiled.policy_search.search` on the cell's
problem: each plan it solves is measured under `torch.compile` as validation measures it
(`tasks.validate.stage.compiled_plan_peak`: `[validate] compile_backend`, the optimizer inside the step where the plan
runs it), on the model built as validation builds it, up to `[validate] compile_probes` plans and `compile_spread`
more solved above them. The cheapest plan measured within the budget replaces the solve stage's; its provenance
keeps the cell's budget (`budget_bytes`, which validation checks the compiled peak against) and what the search
measured (`compiled_search`). Its eager peak may be above the budget: validation checks it against its prediction
instead (tasks/validate/stage.py). Where no plan measured within, the cell keeps the solve stage's answer and says what
the search measured.
"""

from __future__ import annotations

from pathlib import Path

from memplan.runtime.format.plan import Plan, plan_id
from memplan.tasks.compiled.policy_search import MeasuredSearch, search
from memplan.tasks.config import Budget, ModelConfig, PlanSettings, ValidateConfig
from memplan.tasks.models import build_batch, build_loss, build_model
from memplan.tasks.problems import LoadedProblem
from memplan.tasks.records import Solved
from memplan.tasks.solve.core.solution import Solution
from memplan.tasks.solve_stage import annotate, load_cell_problem, plan_of
from memplan.tasks.validate.stage import compiled_plan_peak


def search_cell(graph_path: str | Path, solved: Solved, settings: PlanSettings, spec: ModelConfig, batch_size: int,
                device: str, profile_device: str, seed: int, store: str, validate: ValidateConfig,
                plan_path: str) -> Solved:
    """`solved`, the solve stage's answer for a compiled cell, replaced by the measured search's (module docstring),
    whose plan is written to `plan_path`. The problem is priced by the profile of `profile_device` (the solve
    stage's), the model measured on torch device `device`."""
    loaded = load_cell_problem(graph_path, settings, profile_device, store)
    base = build_model(spec, seed).to(device)
    loss_fn, batch = build_loss(spec), build_batch(spec, batch_size, seed, device)
    budget = solved.budget_bytes

    def measure(solution: Solution) -> int:
        return compiled_plan_peak(_plan(loaded, solution, settings, profile_device, budget), base, loss_fn, batch,
                                  loaded.graph, validate)

    found = search(loaded.problem, budget, measure, solver=solved.solver, options=settings.solve_options(),
                   probes=validate.compile_probes, spread=validate.compile_spread)
    best = found.best
    summary = _summary(found, validate)
    if best is None:
        return solved.model_copy(update={"message": f"{solved.message}; {summary}", "measured_search": summary})
    plan = _plan(loaded, best.solution, settings, profile_device, budget)
    plan.provenance["compiled_search"] = {"solve_budget_bytes": best.solve_budget,
                                          "compiled_peak_bytes": best.measured_peak,
                                          "backend": validate.compile_backend, "plans_measured": len(found.probes)}
    plan.save(plan_path)
    solution = best.solution
    return solved.model_copy(update=dict(
        status=solution.status, feasible=True, predicted_peak_bytes=solution.predicted_peak_bytes,
        objective=solution.objective, gap=solution.gap, backend=solution.backend, smallest_feasible_budget=None,
        solve_seconds=solved.solve_seconds + sum(p.solution.solve_seconds for p in found.probes),
        message=solution.message, measured_search=summary, plan_path=plan_path, plan_id=plan_id(plan)))


def _plan(loaded: LoadedProblem, solution: Solution, settings: PlanSettings, device: str, budget: int) -> Plan:
    """The plan of a solution the search solved at its own budget, marked compiled, with the cell's budget."""
    plan = plan_of(loaded, solution, device)
    annotate(plan, Budget(bytes=budget), settings)
    plan.provenance["budget_bytes"] = budget
    return plan


def _summary(found: MeasuredSearch, validate: ValidateConfig) -> str:
    """One clause on what the search measured and chose."""
    measured = ", ".join(f"solved at {p.solve_budget:,} B: {p.measured_peak:,} B" for p in found.probes)
    head = f"measured search under torch.compile (backend {validate.compile_backend!r}, {len(found.probes)} plans"
    if found.best is None:
        return (f"{head}, none within {found.budget:,} B: {measured}); raise the budget or [validate] compile_probes "
                f"(now {validate.compile_probes})")
    return f"{head}: {measured}) chose the one solved at {found.best.solve_budget:,} B"
