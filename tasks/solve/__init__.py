"""Solvers for memory-constrained schedules (torch-free).

`SOLVERS[name](problem, budget_bytes, options) -> Solution`; every returned schedule has been checked
by the simulator (tasks/solve/simulator.py), the single definition of memory.
"""

from __future__ import annotations

from typing import Callable

from tasks.solve import baselines, checkmate, greedy
from tasks.solve.acg.solver import acg
from tasks.solve.problem import Problem
from tasks.solve.solution import Solution, SolveOptions

Solver = Callable[[Problem, int, SolveOptions], Solution]

SOLVERS: dict[str, Solver] = {
    "checkpoint-all": baselines.checkpoint_all,
    "chen-sqrt-n": baselines.chen_sqrt_n,
    "chen-greedy": baselines.chen_greedy,
    "griewank-log-n": baselines.griewank_log_n,
    "ap-sqrt-n": baselines.ap_sqrt_n,
    "ap-greedy": baselines.ap_greedy,
    "linearized-sqrt-n": baselines.linearized_sqrt_n,
    "linearized-greedy": baselines.linearized_greedy,
    "remat-greedy": greedy.remat_greedy,
    "checkmate-approx": checkmate.checkmate_approx,
    "checkmate": checkmate.checkmate,
    "acg": acg,
}


def solve(problem: Problem, solver: str, budget_bytes: int, options: SolveOptions | None = None) -> Solution:
    """Run the solver named `solver`; raises KeyError listing the known names for an unknown one."""
    if solver not in SOLVERS:
        raise KeyError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)}")
    return SOLVERS[solver](problem, int(budget_bytes), options or SolveOptions())
