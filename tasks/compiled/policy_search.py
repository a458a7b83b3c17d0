"""The cheapest policy-form plan whose peak, measured under torch.compile, fits a budget.

The simulator models eager autograd. Compiled, AOTAutograd's partitioner decides what the graphs keep: it keeps
dropout's mask as bool where eager keeps a float one and recomputes cheap ops a policy leaves to it, so on
bench/policy_form.py's GPT-2 a plan predicted at 0.394 of eager's peak measured 0.325 compiled, while the Llama's
nested plans measured up to 7.5% above their prediction (docs/measurements/peers-cpu.md). Solving at the budget then
either wastes the memory the compiler frees or exceeds the budget. `search` measures instead: it solves at a budget,
measures that plan compiled (`measure`, e.g. `runtime.policy.compiled_peak.compiled_peak`), and moves the budget it
solves at, by the ratio of budget to measured peak while all its measurements lie on one side of the budget
(upwards by `MIN_STEP` at least, below the predicted peak of a plan measured over),
then by bisection between the largest solve budget whose plan measured within the budget and the least whose
plan measured over it. It stops when the two are within `tolerance` of the budget or when `probes` plans have
been measured. A plan met again at another solve budget is not measured again.

The answer is the cheapest measured plan within the budget. For a solver that returns the cheapest of a fixed
candidate set within the budget (`selective-policy`), the plan's predicted peak grows with the solve budget; where
the measured peak does too, the bisection ends at the cheapest candidate that fits measured (tests: exact on
small cases). Where it does not, the answer is still the cheapest of the plans measured within the budget.

The compiled peak does not grow with the solve budget everywhere: on bench/policy_form.py's GPT-2, at torchtitan's
compiled peak (0.396 of eager's), the plans solved at 0.46 and 0.52 of eager's peak measured 0.399 and 0.432 while
those solved at 0.55 and 0.58 measured 0.382 and 0.395, at 7% less compiled time than the best plan solved below
them that fits (docs/measurements/peers-cpu.md). So after the bisection, `spread` more plans are measured, solved at
budgets spaced evenly above the least solve budget whose plan measured over, up to `REACH` times the budget: solved at
a higher budget, a plan found there costs at most what the plans solved below it cost.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

from memplan.tasks.solve import solve
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import default_schedule, simulate
from memplan.tasks.solve.core.solution import Solution, SolveOptions
from memplan.tasks.solve.policy_solver import PolicyOptions

COMPILED = SolveOptions(params=PolicyOptions(compiled=True))
"""`selective-policy` for a model trained under torch.compile: the policy's dispatch modes are traced away."""

GROWTH = 1.25
"""Where no plan fits the solve budget, the next is this much higher."""

MIN_STEP = 0.01
"""Upwards, the solve budget moves by at least this fraction of the budget, twice that after each step that
returned a plan measured already (a plan measured at the budget, e.g. where the compiled peak has a floor, would
otherwise move it a byte at a time)."""


REACH = 1.6
"""The spread probes solve at budgets up to this many times the budget: compiled peaks measured as low as 0.66 of
their eager prediction (bench/policy_form.py's GPT-2, dropout's masks kept as bool:
docs/measurements/peers-cpu.md), so a plan predicted above 1/0.66 times the budget is not expected to fit."""


@dataclass(frozen=True)
class Probe:
    """One plan the search measured: the budget it was solved at, the solution and its measured peak."""

    solve_budget: int
    solution: Solution
    measured_peak: int


@dataclass(frozen=True)
class MeasuredSearch:
    """What `search` measured for `budget`, in order; `best` is its answer."""

    budget: int
    probes: tuple[Probe, ...]

    @property
    def best(self) -> Probe | None:
        """The cheapest (predicted time) probe measured within the budget, the lower peak on a tie."""
        fitting = [p for p in self.probes if p.measured_peak <= self.budget]
        return min(fitting, key=lambda p: (p.solution.objective, p.measured_peak), default=None)


def _identity(solution: Solution) -> str:
    """What makes two solutions one plan: the schedule and the layers split and nested."""
    return json.dumps([solution.schedule, solution.policy_split, solution.policy_nest])


def search(problem: Problem, budget: int, measure: Callable[[Solution], int], *, solver: str = "selective-policy",
           options: SolveOptions = COMPILED, probes: int = 6, spread: int = 0, tolerance: float = 0.002
           ) -> MeasuredSearch:
    """The plans `solver` makes at solve budgets moved until the measured peak fits `budget` as closely as
    `tolerance` (a fraction of it) resolves, `probes` measurements at most, then up to `spread` plans solved above
    them (module docstring)."""
    if budget <= 0 or probes < 1 or spread < 0 or not 0 <= tolerance < 1:
        raise ValueError(f"search needs a positive budget, at least one probe, no negative spread and a tolerance in "
                         f"[0, 1); got budget={budget}, probes={probes}, spread={spread}, tolerance={tolerance}")
    ceiling = simulate(problem, default_schedule(problem)).peak_bytes     # nothing recomputed above it
    measured: dict[str, Probe] = {}
    low: tuple[int, int | None] | None = None     # largest solve budget to go above: (budget, measured peak or
    high: tuple[int, int] | None = None           # None where no plan fits); least one known to give a plan
                                                  # measured over the budget, and that peak
    at, stride = budget, max(1, round(MIN_STEP * budget))
    while True:
        solution = solve(problem, solver, at, options)
        repeated = False
        if solution.feasible:
            key = _identity(solution)
            repeated = key in measured
            if not repeated:
                if len(measured) == probes:
                    break
                measured[key] = Probe(at, solution, int(measure(solution)))
            peak = measured[key].measured_peak
        else:
            peak = None
        if peak is not None and peak > budget:        # every solve budget from its predicted peak up returns it
            over = solution.predicted_peak_bytes
            high = (over, peak) if high is None or over < high[0] else high
        elif low is None or at > low[0]:
            low = (at, peak)
        if high is None:                          # every plan so far within (or none): solve higher
            if low[0] >= ceiling:
                break
            if repeated:
                stride *= 2
            step = low[0] * GROWTH if low[1] is None else low[0] * budget / max(low[1], 1)
            at = min(ceiling, max(low[0] + stride, round(step)))
        elif low is None:                         # every plan so far over: solve lower
            at = min(high[0] - 1, round(high[0] * budget / high[1]))       # below the plan measured over
            if at <= 0:
                break
        elif high[0] - low[0] <= max(1, tolerance * budget):
            break
        else:
            at = (low[0] + high[0]) // 2
    if high is not None:
        _spread(problem, measure, solver, options, measured, high[0], min(ceiling, round(REACH * budget)), spread)
    return MeasuredSearch(budget, tuple(measured.values()))


def _spread(problem: Problem, measure: Callable[[Solution], int], solver: str, options: SolveOptions,
            measured: dict[str, Probe], above: int, reach: int, count: int) -> None:
    """Measures the plans solved at `count` solve budgets spaced evenly in (above, reach], those not measured yet,
    into `measured`."""
    if reach <= above:
        return
    for i in range(1, count + 1):
        at = above + (reach - above) * i // count
        solution = solve(problem, solver, at, options)
        key = _identity(solution) if solution.feasible else None
        if key is not None and key not in measured:
            measured[key] = Probe(at, solution, int(measure(solution)))
