"""A complete solver in one file: the checked example of adding one (README, "Adding a solver").

`example-variants` keeps the default order with no recomputation and, for each implementation variant
name the graph offers, switches every node offering it to that variant when the simulated peak drops.
Registering it is one line in tasks/solve/__init__.py:

    SolverSpec("example-variants", example_variants, "default order, every variant that lowers the peak.",
               ExampleOptions, variants=True),
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import InvalidSchedule, default_schedule, simulate
from memplan.tasks.solve.core.solution import Solution, SolveOptions, checked_solution


@dataclass(frozen=True)
class ExampleOptions:
    """Options of `example-variants`."""

    variants: bool = field(default=True, metadata={"help": "try implementation variants (False: none)."})


def example_variants(problem: Problem, budget: int, options: SolveOptions) -> Solution:
    """Default order; each variant name in turn is kept for every node offering it if the peak drops."""
    start = time.perf_counter()
    schedule = [("compute", node, "default") for _, node in default_schedule(problem)]
    names = sorted({impl for node in range(problem.num_nodes) for impl in problem.impls(node)[1:]})
    for name in names if options.params.variants else []:
        trial = [(kind, node, name if name in problem.impls(node) else impl) for kind, node, impl in schedule]
        try:
            if simulate(problem, trial).peak_bytes < simulate(problem, schedule).peak_bytes:
                schedule = trial
        except InvalidSchedule:          # a variant whose partner node does not offer it
            continue
    return checked_solution(problem, "example-variants", budget, schedule, solve_seconds=time.perf_counter() - start)
