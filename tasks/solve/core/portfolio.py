"""No answer worse than a known one: the expensive solvers' results checked against the cheap solvers'.

A MILP or LP solver (Checkmate, its LP rounding) may stop at its time limit with a poor incumbent or none,
and LP rounding may round to a schedule a greedy beats. `best_known` runs the cheap solvers at the same
budget on the whole problem, implementation variants included (`dtr` runs them, e.g. the GELU's tanh by its
sigmoid identity, even where the expensive solver plans without them), and returns the cheapest feasible
schedule by predicted cost, keeping the expensive solver's bound where it holds and saying which solver's
schedule won (`Solution.source`). When the expensive solver found
nothing because of its time limit, the status is `time_limit` (a plan, optimality unknown); when it found
nothing for another reason (a hierarchical composition that does not fit), the status is `feasible`.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable, Mapping

from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.solution import Solution, SolveOptions

CHEAP = ("ap-greedy", "linearized-greedy", "acg", "remat-greedy", "dtr")
"""The solvers every portfolio solve consults (seconds on graphs of thousands of nodes)."""

CHEAP_TIME_LIMIT_S = 30.0
"""Each cheap solver's own limit: they finish in seconds, so the expensive solver's limit does not cut them."""


def best_known(problem: Problem, budget: int, solution: Solution, options: SolveOptions,
               cheap: Mapping[str, Callable[[Problem, int, SolveOptions], Solution]], same_space: bool = True
               ) -> Solution:
    """`solution`, or the cheapest feasible schedule of the `cheap` solvers on `problem` at `budget` when it costs
    less (or `solution` has none); the answer keeps `solution`'s solver name and model size, and its bound when
    `same_space` (its solver saw `problem` whole; False: it planned without the implementation variants a cheap
    solver may run, so neither its proof of optimality nor its bound holds against them)."""
    if same_space and solution.gap is not None and solution.gap <= 0.0:      # proved optimal: nothing cheaper exists
        return solution
    start = time.perf_counter()
    found = [s for s in (run(problem, budget, SolveOptions(time_limit=CHEAP_TIME_LIMIT_S, threads=options.threads))
                         for run in cheap.values()) if s.feasible]
    best = min(found, key=lambda s: (_cost(s), s.predicted_peak_bytes), default=None)
    seconds = solution.solve_seconds + time.perf_counter() - start
    if best is None or (solution.feasible and _cost(solution) <= _cost(best)):
        return replace(solution, solve_seconds=seconds)
    why = (f"{solution.solver} found no schedule ({solution.status}: {solution.message})" if not solution.feasible
           else f"{best.solver}'s schedule costs {best.objective:.6g}, {solution.solver}'s {solution.objective:.6g}")
    stopped = solution.status == "time_limit" or (solution.status == "no_solution" and "time limit" in solution.message)
    status = ("time_limit" if stopped else "optimal" if same_space and solution.bound is not None
              and _cost(best) <= solution.bound * (1 + 1e-9) else "feasible")
    return replace(solution, status=status, schedule=best.schedule, simulation=best.simulation, addresses=None,
                   bound=solution.bound if same_space else None,
                   source=best.solver, solve_seconds=seconds, message=f"{why}: returned {best.solver}'s schedule")


def _cost(solution: Solution) -> float:
    """A feasible solution's objective: a checked schedule always carries its simulation (`checked_solution`)."""
    cost = solution.objective
    assert cost is not None, f"{solution.solver}'s schedule has no simulation"
    return cost
