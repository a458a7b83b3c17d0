"""Checkmate solvers (Jain et al. 2020): the optimal MILP (`checkmate`, eq. 9) and the LP relaxation with
two-phase rounding (`checkmate-approx`, sec. 5, Algorithm 2). The model itself is in remat_milp.py.

Solver options: `CheckmateOptions` and `CheckmateApproxOptions` (typed, one line of help per field).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np

from memplan.tasks.solve.core.remat_milp import (CheckmateLayout, assignment_from_schedule, build_model, schedule_from_solution,
                                         expand_ranges)
from memplan.tasks.solve.core.checkpoints import recompute_closure
from memplan.tasks.solve.core.coarsen import solve_coarsened
from memplan.tasks.solve.core.milp import MilpModel, MilpOptions, Progress, relative_gap, solve_lp_sweep, solve_milp
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import simulate
from memplan.tasks.solve.core.solution import Solution, SolveOptions, checked_solution, min_budget_lower_bound

log = logging.getLogger("memplan.solve")

ALLOWANCES = (0.0, 0.05, 0.1, 0.2, 0.3)
THRESHOLDS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
Formulation = Literal["tight", "paper"]


@dataclass(frozen=True)
class CheckmateApproxOptions:
    """Options of `checkmate-approx`."""

    formulation: Formulation = field(default="tight", metadata={
        "help": "FREE linearization: 'tight' (ours, fewer rows) or 'paper' (eq. 7a-7c)."})
    allowances: tuple[float, ...] = field(default=ALLOWANCES, metadata={
        "help": "budget allowances eps: the LP is solved under (1 - eps) * budget (sec. 5.3)."})
    thresholds: tuple[float, ...] = field(default=THRESHOLDS, metadata={
        "help": "rounding thresholds p of two-phase rounding: S_int = [S* > p] (Algorithm 2)."})


@dataclass(frozen=True)
class CheckmateOptions:
    """Options of `checkmate`."""

    formulation: Formulation = field(default="tight", metadata={
        "help": "FREE linearization: 'tight' (ours, fewer rows) or 'paper' (eq. 7a-7c)."})
    warm_start: Literal["dtr", "greedy", "approx", "none"] = field(default="dtr", metadata={
        "help": "heuristic whose schedule starts the MILP: dtr (its walks of the default order; remat-greedy "
                "when they find none), remat-greedy, checkmate-approx or none."})
    allowances: tuple[float, ...] = field(default=(0.0, 0.1, 0.2), metadata={
        "help": "budget allowances of the checkmate-approx warm start (warm_start = 'approx')."})
    coarsen: bool = field(default=False, metadata={
        "help": "solve on the graph with single-reader chains merged (tasks/solve/core/coarsen.py), then expand."})


def two_phase_rounding(problem: Problem, L: CheckmateLayout, s_star: np.ndarray, threshold: float) -> list[tuple[str, int]]:
    """Algorithm 2: S_int = [S* > threshold]; R = I (eq. 8a); in each stage materialize what S_int
    retains into the next stage but does not hold now (eq. 1c), then recompute missing inputs in
    reverse topological order (eq. 1b). `s_star[t, iv]` is the relaxed S over the layout's values."""
    s_int = s_star > threshold
    resident = problem.value_producer < 0
    schedule: list[tuple[str, int]] = []
    for t in range(L.n):
        resident[L.vals] = s_int[t]
        targets = [int(L.order[t])]
        if t + 1 < L.n:
            targets += problem.value_producer[L.vals[s_int[t + 1] & ~s_int[t]]].tolist()
        schedule.extend(("compute", node) for node in recompute_closure(problem, targets, resident))
    return schedule


def _s_matrix(L: CheckmateLayout, x: np.ndarray) -> np.ndarray:
    iv, t = expand_ranges(L.pp + 1, np.full(len(L.pp), L.n))
    s = np.zeros((L.n, len(L.vals)))
    s[t, iv] = x[L.s(t, iv)]
    return s


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(deadline - time.perf_counter(), 0.0)


def _infeasible(problem: Problem, solver: str, budget: int, lower: int, seconds: float, why: str, **kw) -> Solution:
    return Solution(solver, budget, "infeasible", solve_seconds=seconds, min_budget_lower_bound=lower,
                    message=why, **kw)


def _below_lower_bound(problem: Problem, solver: str, budget: int, lower: int, start: float) -> Solution:
    return _infeasible(problem, solver, budget, lower, time.perf_counter() - start,
                       f"no schedule fits: some node needs {lower} bytes for its inputs, outputs and workspace")


def checkmate_approx(problem: Problem, budget: int, options: SolveOptions) -> Solution:
    """LP relaxation of eq. (9) (sec. 5.1) under (1 - eps) budget for each allowance eps (sec. 5.3; each
    LP re-solved from the previous basis), two-phase rounding (Algorithm 2) at each threshold, best
    simulated schedule within the budget. The LP objective at eps = 0 is a lower bound on the optimal
    cost."""
    start = time.perf_counter()
    deadline = None if options.time_limit is None else start + options.time_limit
    lower = min_budget_lower_bound(problem)
    if budget < lower:
        return _below_lower_bound(problem, "checkmate-approx", budget, lower, start)
    opts: CheckmateApproxOptions = options.params
    allowances = opts.allowances
    model, L = build_model(problem, budget, opts.formulation)
    size = (model.num_variables, model.num_constraints)
    best, bound, why = None, None, "no rounding fits the budget"
    lps = solve_lp_sweep(model, [1.0 - eps for eps in allowances],
                         MilpOptions(time_limit=_remaining(deadline), threads=options.threads))
    for eps, lp in zip(allowances, lps):
        if lp.status == "infeasible":
            if eps == 0.0:
                return _infeasible(problem, "checkmate-approx", budget, max(lower, budget + 1),
                                   time.perf_counter() - start, "the LP relaxation of eq. (9) is infeasible",
                                   num_variables=size[0], num_constraints=size[1], backend="highs")
            break
        if lp.x is None:
            why = ("time limit reached" if lp.status == "time_limit" else
                   f"the LP relaxation stopped without a solution ({lp.message})")
            break
        if eps == 0.0 and lp.status == "optimal":
            bound = lp.objective
        s_star = _s_matrix(L, lp.x)
        for p in opts.thresholds:
            if deadline is not None and time.perf_counter() >= deadline:
                break
            schedule = two_phase_rounding(problem, L, s_star, p)
            sim = simulate(problem, schedule)
            if sim.peak_bytes <= budget and (best is None or sim.compute_cost < best[1].compute_cost):
                best = (schedule, sim)
                log.info("checkmate-approx eps=%.2f p=%.1f: cost %.6g peak %d", eps, p, sim.compute_cost, sim.peak_bytes)
    if best is None and deadline is not None and time.perf_counter() >= deadline:
        why = "time limit reached"
    return checked_solution(problem, "checkmate-approx", budget, best[0] if best else None,
                            status="feasible", bound=bound, solve_seconds=time.perf_counter() - start,
                            backend="highs", num_variables=size[0], num_constraints=size[1],
                            message="" if best else why)


def checkmate(problem: Problem, budget: int, options: SolveOptions) -> Solution:
    """The MILP of eq. (9) with frontier-advancing stages (8a-8c), FREE linearization (7a-7c) and the
    eliminations of 4.8, started from a heuristic schedule (`warm_start`: "dtr" (default; remat-greedy
    when dtr finds none), "greedy" (remat-greedy), "approx" (checkmate-approx) or "none";
    `SolveOptions.mip_start` takes precedence).

    The bound is the larger of the MILP's dual bound and sum of costs (eq. 8a runs every node once);
    when the start is already within `gap` of it, the MILP is skipped. An infeasible MILP proves that no
    frontier-advancing schedule in the default order fits."""
    start = time.perf_counter()
    deadline = None if options.time_limit is None else start + options.time_limit
    lower = min_budget_lower_bound(problem)
    if budget < lower:
        return _below_lower_bound(problem, "checkmate", budget, lower, start)
    floor = float(problem.cost.sum())
    opts: CheckmateOptions = options.params
    if opts.coarsen:
        return solve_coarsened(checkmate, problem, budget, replace(options, params=replace(opts, coarsen=False)))
    incumbent = options.mip_start
    warm = opts.warm_start
    if incumbent is None and warm == "dtr":
        incumbent = options.peers["dtr"](problem, budget, SolveOptions(time_limit=_remaining(deadline),
                                                                       params={"orders": ("default",)})).schedule
    if incumbent is None and warm in ("greedy", "dtr"):
        incumbent = options.peers["remat-greedy"](problem, budget, SolveOptions(time_limit=_remaining(deadline))).schedule
    elif incumbent is None and warm == "approx":
        approx = checkmate_approx(problem, budget, SolveOptions(
            time_limit=_remaining(deadline), threads=options.threads,
            params=CheckmateApproxOptions(formulation=opts.formulation, allowances=opts.allowances)))
        if approx.status == "infeasible":
            approx.solver, approx.solve_seconds = "checkmate", time.perf_counter() - start
            return approx
        incumbent = approx.schedule
    progress = []
    if incumbent is not None:
        cost = simulate(problem, incumbent).compute_cost
        progress.append(Progress(time.perf_counter() - start, cost, floor))
        if relative_gap(cost, floor) <= options.gap:
            return checked_solution(problem, "checkmate", budget, incumbent, status="optimal", bound=floor,
                                    solve_seconds=time.perf_counter() - start, progress=progress,
                                    message=f"the {warm} start is within the gap of sum of costs; MILP skipped")
    model, L = build_model(problem, budget, opts.formulation)
    mip_start = _feasible_start(problem, model, L, incumbent, budget)
    offset = time.perf_counter() - start
    result = solve_milp(model, MilpOptions(backend=options.backend, time_limit=_remaining(deadline),
                                           gap=options.gap, threads=options.threads, mip_start=mip_start))
    progress += [Progress(p.seconds + offset, p.incumbent, max(p.bound, floor) if p.bound is not None else floor)
                 for p in result.progress]
    bound = max(result.bound, floor) if result.bound is not None else floor
    common = dict(backend=result.backend, num_variables=result.num_variables, num_constraints=result.num_constraints,
                  progress=progress, bound=bound)
    seconds = time.perf_counter() - start
    if result.status == "infeasible":
        return _infeasible(problem, "checkmate", budget, max(lower, budget + 1), seconds,
                           "the MILP proved that no frontier-advancing schedule in the default order fits", **common)
    if result.x is not None:
        schedule = schedule_from_solution(L, result.x)
        status = "optimal" if result.status == "optimal" else "feasible"
    elif incumbent is not None:
        schedule, status = incumbent, "feasible"
    else:
        schedule, status = None, "no_solution"
    return checked_solution(problem, "checkmate", budget, schedule, status=status, solve_seconds=seconds,
                            message=result.message, **common)


def _feasible_start(problem: Problem, model: MilpModel, L: CheckmateLayout, schedule: list | None,
                    budget: int) -> np.ndarray | None:
    """The MILP assignment of a schedule, or None when there is none or it violates the model."""
    if schedule is None or simulate(problem, schedule).peak_bytes > budget:
        return None
    x = assignment_from_schedule(problem, L, schedule)
    if x is None:
        log.info("mip start ignored: the schedule is not frontier-advancing in the default order")
        return None
    Ax = model.A @ x
    tol = 1e-9 * (abs(model.A) @ np.abs(x)) + 1e-9
    if (np.any(Ax < model.row_lower - tol) or np.any(Ax > model.row_upper + tol)
            or np.any(x < model.col_lower - 1e-9) or np.any(x > model.col_upper + 1e-9)):
        log.warning("mip start ignored: its assignment violates the model")
        return None
    return np.clip(x, model.col_lower, model.col_upper)
