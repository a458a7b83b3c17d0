"""The `olla` solver: the operator order of the whole training step that minimizes the peak, without
recomputation (Steiner et al. 2022, eq. 14, lifetime.py). Its addresses come from the location ILP
(location.py), which the solve stage applies to any solver's schedule (`addresses = "olla"`).

Early weight-update anchoring (sec. 4.3) is not applied: the captured step has no optimizer step, its
gradients are graph outputs that stay resident to the end of the step, so there is no update node
to anchor. The control edges of sec. 4.3 are used instead to keep random nodes in their default
order (spans.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from memplan.tasks.solve.olla.lifetime import WINDOW, lifetime_order
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import default_schedule, simulate
from memplan.tasks.solve.core.solution import Solution, SolveOptions, checked_solution


@dataclass(frozen=True)
class OllaOptions:
    """Options of `olla`."""

    warm_start: bool = field(default=True, metadata={
        "help": "start the whole-graph ILP from the better of the default (PyTorch) order and a greedy "
                "memory order, improved by the window search."})
    window: int = field(default=WINDOW, metadata={
        "help": "nodes per window of the local search with the lifetime ILP (0: whole-graph ILP only)."})
    whole_graph: bool = field(default=True, metadata={
        "help": "after the window search, run the whole-graph ILP of eq. 14 (bound, further gains) in the time left."})


def olla(problem: Problem, budget: int, options: SolveOptions) -> Solution:
    """Every node once, in the order of eq. 14 (the best incumbent within the time limit); the bound is
    the sum of costs (no recomputation) and the message gives the peak against the ILP's bound."""
    start = time.perf_counter()
    opts: OllaOptions = options.params
    found = lifetime_order(problem, time_limit=options.time_limit, gap=options.gap, backend=options.backend,
                           threads=options.threads, warm_start=opts.warm_start, window=opts.window,
                           whole_graph=opts.whole_graph)
    eager = simulate(problem, default_schedule(problem)).peak_bytes
    bound = "-" if found.bound_bytes is None else f"{found.bound_bytes:.0f}"
    message = (f"peak {found.peak_bytes} B (default order {eager} B), lifetime ILP bound {bound} B, "
               f"whole-graph ILP {found.status}, order from {found.source}")
    status = "optimal" if found.status == "optimal" else "feasible"
    return checked_solution(problem, "olla", budget, [("compute", v) for v in found.order],
                            status=status,
                            bound=float(problem.cost.sum()), solve_seconds=time.perf_counter() - start,
                            backend=found.backend, num_variables=found.num_variables,
                            num_constraints=found.num_constraints, message=message)
