"""The solve stage: one matrix cell of pipeline.toml solved against the newest complete profile.

Plain functions (the Prefect task in flows/steps.py wraps `solve_case`); torch-free.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from runtime.graph import OpGraph
from runtime.plan import Plan
from tasks.config import Budget
from tasks.solve import SOLVERS
from tasks.solve.problem import Problem
from tasks.solve.simulator import default_schedule, simulate
from tasks.solve.solution import SolveOptions, min_budget_lower_bound
from tasks.store import load_costs


@dataclass(frozen=True)
class Solved:
    """A solver's answer for one matrix cell, with the numbers the report needs."""

    solver: str
    status: str
    feasible: bool
    budget_bytes: int
    checkpoint_all_peak_bytes: int
    checkpoint_all_cost: float
    predicted_peak_bytes: int | None
    objective: float | None
    gap: float | None
    solve_seconds: float
    backend: str | None
    min_budget_lower_bound: int | None
    smallest_feasible_budget: int | None
    message: str
    plan_path: str | None
    profile_run_id: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def solve_case(graph_path: str | Path, solver: str, budget: Budget, options: dict[str, Any], device: str, store: str,
               plan_path: str) -> Solved:
    """Solve one cell: build the `Problem` from the graph and its newest complete profile, resolve the
    budget against the checkpoint-all peak (eager order, no recomputation), run the solver and, when it
    finds a schedule, write the plan to `plan_path`."""
    graph = OpGraph.load(graph_path)
    costs = load_costs(graph.fingerprint, device, root=store)
    problem = Problem.from_graph(graph, costs)
    eager = simulate(problem, default_schedule(problem))
    budget_bytes = budget.resolve(eager.peak_bytes)
    solution = SOLVERS[solver](problem, budget_bytes, SolveOptions(**options))
    lower = solution.min_budget_lower_bound or min_budget_lower_bound(problem)
    smallest = None
    if solution.feasible:
        plan = Plan.load(solution.to_plan(problem, device=device, profile_run_id=costs.run_id))
        plan.predicted["time_ms"] = plan.predicted["compute_cost"]  # node costs are profiled milliseconds
        plan.save(plan_path)
    elif eager.peak_bytes > budget_bytes:
        smallest = smallest_feasible_budget(problem, max(lower, budget_bytes), eager.peak_bytes)
    return Solved(
        solver=solver,
        status=solution.status,
        feasible=solution.feasible,
        budget_bytes=budget_bytes,
        checkpoint_all_peak_bytes=eager.peak_bytes,
        checkpoint_all_cost=eager.compute_cost,
        predicted_peak_bytes=solution.predicted_peak_bytes,
        objective=solution.objective,
        gap=solution.gap,
        solve_seconds=solution.solve_seconds,
        backend=solution.backend,
        min_budget_lower_bound=lower,
        smallest_feasible_budget=smallest,
        message=solution.message,
        plan_path=plan_path if solution.feasible else None,
        profile_run_id=costs.run_id,
    )


PROBES = ("ap-greedy", "linearized-greedy")


def smallest_feasible_budget(problem: Problem, infeasible: int, feasible: int, rel_tol: float = 0.005) -> int:
    """Bisection between a budget known infeasible and one known feasible (the checkpoint-all peak):
    the smallest budget, within `rel_tol`, at which a fast greedy baseline (`PROBES`) finds a schedule."""
    probes = [SOLVERS[name] for name in PROBES if name in SOLVERS]
    while probes and feasible - infeasible > rel_tol * feasible:
        middle = (infeasible + feasible) // 2
        found = [s.predicted_peak_bytes for s in (probe(problem, middle, SolveOptions()) for probe in probes) if s.feasible]
        if found:
            feasible = min(found)
        else:
            infeasible = middle
    return feasible
