"""The solve stage: one solver at one budget on one loaded problem, and the plan it writes.

Plain functions: `memplan solve` calls `solve_loaded`, the pipeline's Prefect task (flows/steps.py)
calls `solve_case`, so both resolve budgets, run solvers, place addresses and fill plan predictions the
same way.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

from runtime.plan import graph_provenance
from tasks.config import Budget, VariantChoice
from tasks.problems import LoadedProblem, load_problem
from tasks.solve import SOLVERS, solve
from tasks.solve.addresses import greedy_addresses
from tasks.solve.olla import olla_addresses
from tasks.solve.problem import Problem
from tasks.solve.simulator import Simulation, default_schedule, normalize_schedule, simulate
from tasks.solve.solution import Solution, SolveOptions, min_budget_lower_bound

Addresses = Literal["none", "greedy", "olla"]
PROBES = ("ap-greedy", "linearized-greedy")


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
    arena_bytes: int | None
    objective: float | None
    gap: float | None
    solve_seconds: float
    backend: str | None
    min_budget_lower_bound: int | None
    smallest_feasible_budget: int | None
    message: str
    plan_path: str | None
    profile_run_id: str | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def solve_loaded(loaded: LoadedProblem, solver: str, budget: Budget, options: SolveOptions,
                 addresses: Addresses = "none") -> tuple[Solution, Simulation]:
    """Resolve `budget` against the checkpoint-all peak (default order, no recomputation), run the
    solver, and with `addresses` "greedy" (largest first, best gap) or "olla" (OLLA's location ILP, within
    the same time limit) place the schedule's copies. Returns the solution and the checkpoint-all simulation."""
    problem = loaded.problem
    eager = simulate(problem, default_schedule(problem))
    solution = solve(problem, solver, budget.resolve(eager.peak_bytes), options)
    if addresses != "none" and solution.feasible:              # addresses leave the live peak as it is
        steps = in_place_steps(loaded, solution.schedule)
        placed = greedy_addresses(problem, solution.simulation, steps) if addresses == "greedy" else \
            olla_addresses(problem, solution.simulation, steps, time_limit=options.time_limit, gap=options.gap,
                           backend=options.backend, threads=options.threads).addresses
        solution = replace(solution, simulation=simulate(problem, solution.schedule, placed), addresses=placed)
    return solution, eager


def in_place_steps(loaded: LoadedProblem, schedule: list) -> np.ndarray | None:
    """Schedule steps whose copies arena mode writes in place on the profiled device: default-implementation
    computes of `runtime.arena.in_place_nodes` (None for benchmark graphs, which have no ops: all steps)."""
    if loaded.graph is None:
        return None
    from runtime.arena import in_place_nodes

    nodes = in_place_nodes(loaded.graph, loaded.device or "cpu")
    steps = normalize_schedule(schedule)
    return np.array([s.get("compute") in nodes and "impl" not in s for s in steps], dtype=bool)


def solve_case(graph_path: str | Path, solver: str, budget: Budget, options: SolveOptions, device: str, store: str,
               plan_path: str, addresses: Addresses = "none", variants: VariantChoice = "all") -> Solved:
    """Solve one cell of the pipeline matrix against the graph's newest complete profile on `device`, offering
    the implementation variants of `variants`; when the solver finds a schedule, write its plan to `plan_path`."""
    loaded = load_problem(graph_path, device=device, store=store, variants=variants)
    solution, eager = solve_loaded(loaded, solver, budget, options, addresses)
    problem = loaded.problem
    lower = solution.min_budget_lower_bound or min_budget_lower_bound(problem)
    smallest = None
    if solution.feasible:
        plan = solution.to_plan(problem, device=device, profile_run_id=loaded.profile_run_id)
        if loaded.graph is not None:
            plan.provenance.update(graph_provenance(loaded.graph))
        plan.save(plan_path)
    elif eager.peak_bytes > solution.budget_bytes:
        smallest = smallest_feasible_budget(problem, max(lower, solution.budget_bytes), eager.peak_bytes)
    return Solved(
        solver=solver,
        status=solution.status,
        feasible=solution.feasible,
        budget_bytes=solution.budget_bytes,
        checkpoint_all_peak_bytes=eager.peak_bytes,
        checkpoint_all_cost=eager.compute_cost,
        predicted_peak_bytes=solution.predicted_peak_bytes,
        arena_bytes=None if solution.simulation is None else solution.simulation.arena_bytes,
        objective=solution.objective,
        gap=solution.gap,
        solve_seconds=solution.solve_seconds,
        backend=solution.backend,
        min_budget_lower_bound=lower,
        smallest_feasible_budget=smallest,
        message=solution.message,
        plan_path=plan_path if solution.feasible else None,
        profile_run_id=loaded.profile_run_id,
    )


def smallest_feasible_budget(problem: Problem, infeasible: int, feasible: int, rel_tol: float = 0.005) -> int:
    """Bisection between a budget known infeasible and one known feasible (the checkpoint-all peak):
    the smallest budget, within `rel_tol`, at which a fast greedy baseline (`PROBES`) finds a schedule."""
    probes = [name for name in PROBES if name in SOLVERS]
    while probes and feasible - infeasible > rel_tol * feasible:
        middle = (infeasible + feasible) // 2
        found = [s.predicted_peak_bytes for s in (solve(problem, name, middle) for name in probes) if s.feasible]
        if found:
            feasible = min(found)
        else:
            infeasible = middle
    return feasible
