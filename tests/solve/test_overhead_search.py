"""Plans by overhead: the least-peak schedule within (1 + max_overhead) x the checkpoint-all cost."""

from __future__ import annotations

import pytest

from memplan.tasks.solve import solve
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import default_schedule, simulate
from memplan.tasks.solve.core.solution import SolveOptions, min_budget_lower_bound
from memplan.tasks.solve_stage import bisect_budget, least_memory_within, limit_search
from tests.solve.test_monet import masked_chain


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


def stepped_probe(step: int, scale: float, probed: list):
    """Schedules peaking at multiples of `step` bytes, costing 1 + scale / peak, none under 10 steps."""
    def probe(budget: int) -> tuple[int, float] | None:
        probed.append(budget)
        peak = budget - budget % step
        return (peak, 1 + scale / peak) if peak >= 10 * step else None
    return probe


@pytest.mark.parametrize("step, limit", [(7, 1.5), (7, 3.0), (1, 1.25), (13, 1.1)])
def test_the_limit_search_finds_the_least_peak_within_the_limit_in_fewer_probes_than_bisection(step, limit):
    """Against every budget: the least peak whose cost is within the limit, exactly (rel_tol 0) and within the
    tolerance, each in fewer probes than a bisection to the same tolerance."""
    top, scale = 10_000, 500.0
    exact = min(peak for peak in range(10 * step, top + 1, step) if 1 + scale / peak <= limit)
    for rel_tol in (0.0, 0.005, 0.05):
        probed, bisected = [], []
        found = limit_search(0, (top, 1 + scale / top), stepped_probe(step, scale, probed), limit, rel_tol)
        probe = stepped_probe(step, scale, bisected)
        reference = bisect_budget(0, top, lambda b: (a := probe(b)) and a[1] <= limit and a[0] or None, rel_tol)
        assert exact <= found <= (1 + rel_tol) * exact and exact <= reference <= (1 + rel_tol) * exact
        assert len(probed) < len(bisected), (rel_tol, probed, bisected)


def test_the_limit_search_ends_where_costs_do_not_fall_with_the_budget():
    """A heuristic's costs jump about as the budget falls: the search still ends at a peak within the limit whose
    next budget down it probed and found none within (the bisection's guarantee)."""
    probed = []

    def probe(budget: int) -> tuple[int, float] | None:
        probed.append(budget)
        return (budget, 1.0 + (0.3 if budget % 3 == 0 else 0.05) * 1000 / budget) if budget >= 100 else None

    found = limit_search(0, (1000, 1.0), probe, 1.2, rel_tol=0.0)
    assert found - 1 in probed and len(probed) <= 10
    assert probe(found)[1] <= 1.2 < probe(found - 1)[1]


@pytest.mark.parametrize("seed", [4, 5, 9])
def test_dtr_told_the_searchs_limits_decides_every_budget_as_a_plain_solve(seed):
    """With implementation variants: at every budget a dtr solve sharing the search's memo and told `enough` (the
    limit) and `cost_limit` finds a schedule within the limit exactly where a plain solve does, and between the
    limit and cost_limit the plain solve's schedule itself."""
    problem = masked_chain(seed)
    eager = simulate(problem, default_schedule(problem))
    limit, cap = 1.1 * eager.compute_cost, 1.3 * eager.compute_cost
    hinted = SolveOptions(enough=limit, cost_limit=cap, memo={})
    for budget in range(eager.peak_bytes, min_budget_lower_bound(problem) - 1, -1):
        plain, told = solve(problem, "dtr", budget), solve(problem, "dtr", budget, hinted)
        within = plain.feasible and plain.objective <= limit + 1e-9
        assert within == (told.feasible and told.objective <= limit + 1e-9), budget
        assert not told.feasible or told.predicted_peak_bytes <= budget and told.objective <= cap + 1e-9
        if plain.feasible and limit + 1e-9 < plain.objective <= cap:
            assert told.objective == pytest.approx(plain.objective), budget
