"""Plans by overhead: the least-peak schedule within (1 + max_overhead) x the checkpoint-all cost."""

from __future__ import annotations

import pytest

from memplan.tasks.solve import solve
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import default_schedule, simulate
from memplan.tasks.solve.core.solution import min_budget_lower_bound
from memplan.tasks.solve_stage import bisect_budget, least_memory_within


def uneven_linear_graph() -> Problem:
    """Checkmate's linear training graph of 4 layers with uneven costs and sizes, so that recomputing
    different nodes saves different memory at different prices."""
    n, size = 4, 9
    edges = [(i, i + 1) for i in range(size - 1)] + [(i, 2 * n - i) for i in range(n)]
    costs = [1.0, 4.0, 2.0, 6.0, 1.0, 3.0, 5.0, 2.0, 1.0]
    sizes = [30, 10, 50, 20, 4, 20, 50, 10, 30]
    return Problem.from_edges(costs, sizes, edges, backward=[i > n for i in range(size)], name="uneven4")


def test_bisection_finds_the_least_accepted_budget_and_jumps_to_the_peaks_it_is_given():
    probed = []

    def probe(budget: int) -> int | None:
        probed.append(budget)
        return budget - budget % 10 if budget >= 40 else None       # schedules peak at multiples of 10

    assert bisect_budget(0, 100, probe, rel_tol=0.0) == 40
    assert all(b >= 0 for b in probed) and len(probed) <= 8
    assert bisect_budget(0, 1000, lambda b: b if b >= 370 else None, rel_tol=0.05) in range(370, 421)


@pytest.mark.parametrize("max_overhead", [0.0, 0.1, 0.25, 0.5, 1.0])
def test_the_plan_is_the_least_peak_schedule_within_the_overhead_limit(max_overhead):
    """Against a brute force: the exact solver (checkmate's MILP) at every budget from the lower bound to the
    checkpoint-all peak, keeping the schedules whose cost is within the limit."""
    problem = uneven_linear_graph()
    eager = simulate(problem, default_schedule(problem))
    limit = (1 + max_overhead) * eager.compute_cost
    within = [s.predicted_peak_bytes for s in (solve(problem, "checkmate", b)
                                               for b in range(min_budget_lower_bound(problem), eager.peak_bytes + 1))
              if s.feasible and s.objective <= limit + 1e-9]
    found = least_memory_within(problem, "checkmate", max_overhead, eager, rel_tol=0.0)
    assert found.feasible and found.objective <= limit + 1e-9
    assert found.predicted_peak_bytes == min(within)
    assert found.predicted_peak_bytes <= found.budget_bytes


@pytest.mark.parametrize("solver", ["dtr", "ap-greedy", "acg"])
def test_a_heuristic_solvers_plan_is_the_least_peak_of_its_budget_sweep_within_the_limit(solver):
    """The pipeline's default max_overhead solvers are heuristics whose cost need not fall as the budget does, which
    a bisection could skip past: their plan at +10% must still be the least peak of that solver's schedules at
    every budget whose predicted cost is within the limit (bench/max_overhead.py measures the same on real models)."""
    problem = uneven_linear_graph()
    eager = simulate(problem, default_schedule(problem))
    limit = 1.1 * eager.compute_cost * (1 + 1e-12)
    within = [s.predicted_peak_bytes for s in (solve(problem, solver, b)
                                               for b in range(min_budget_lower_bound(problem), eager.peak_bytes + 1))
              if s.feasible and s.objective <= limit]
    found = least_memory_within(problem, solver, 0.1, eager, rel_tol=0.0)
    assert found.feasible and found.objective <= limit
    assert found.predicted_peak_bytes == min(within) < eager.peak_bytes


def test_more_overhead_buys_less_memory_down_to_the_floor():
    problem = uneven_linear_graph()
    eager = simulate(problem, default_schedule(problem))
    peaks = [least_memory_within(problem, "checkmate", x, eager, rel_tol=0.0).predicted_peak_bytes
             for x in (0.0, 0.25, 1.0, 10.0)]
    assert peaks == sorted(peaks, reverse=True) and peaks[0] > peaks[-1]


def test_a_solver_whose_one_schedule_costs_more_than_the_limit_says_so():
    """chen-sqrt-n makes one schedule whatever the budget: it cannot honour a limit its schedule's cost exceeds,
    and the answer says what that schedule costs instead of returning it."""
    problem = uneven_linear_graph()
    eager = simulate(problem, default_schedule(problem))
    fixed = solve(problem, "chen-sqrt-n", eager.peak_bytes)
    overhead = fixed.objective / eager.compute_cost - 1
    assert fixed.feasible and overhead > 0
    refused = least_memory_within(problem, "chen-sqrt-n", overhead / 2, eager)
    assert not refused.feasible and refused.schedule is None
    assert refused.message == (f"no schedule within +{overhead / 2:.0%} predicted overhead: even at the checkpoint-all "
                               f"peak its schedule there costs {overhead:+.1%}")
    honoured = least_memory_within(problem, "chen-sqrt-n", overhead, eager)
    assert honoured.feasible and honoured.objective == fixed.objective
