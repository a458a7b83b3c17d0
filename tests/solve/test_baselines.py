from math import comb

import pytest

from memplan.tasks.solve import SOLVERS, solve
from memplan.tasks.solve.baselines import articulation_points, is_linear, revolve_cost, revolve_schedule
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import default_schedule, simulate
from memplan.tasks.solve.core.solution import SolveOptions

EXACT = {"checkmate", "monet", "monet-noop", "moccasin", "olla"}
"""MILP / CP-SAT solvers, tested against exhaustive optima on small graphs (test_checkmate, test_monet,
test_moccasin, test_olla): on the benchmark graphs their model build alone outlasts a short time limit."""
HEURISTICS = [name for name in SOLVERS if name not in EXACT]
LP_BASED = {"checkmate-approx", "hierarchical"}
"""Heuristics built on LPs / MILPs: here only on the graphs of at most 60 nodes (on the larger ones they
spend the whole short time limit; test_feasible_budgets and test_hierarchical test them further)."""


@pytest.mark.parametrize("fraction", [0.8])
def test_every_heuristic_on_every_benchmark_graph(benchmark_paths, fraction):
    """A schedule the simulator accepts within the budget, or a clear statement that none was found (at the
    literature's tighter common budget; tests/solve/test_feasible_budgets.py pins where each must succeed).
    Of the random layered graphs only n100: on n250-n1000 every solver just runs into the 2 s limit
    (bench/solvers.py and bench/random_layered.py measure them)."""
    for path in benchmark_paths:
        if path.name.startswith("random_layered") and not path.name.startswith("random_layered_n100_"):
            continue
        problem = Problem.from_node_link(path)
        budget = int(fraction * simulate(problem, default_schedule(problem)).peak_bytes)
        for name in HEURISTICS:
            if name in LP_BASED and len(problem.cost) > 60:
                continue
            sol = solve(problem, name, budget, SolveOptions(time_limit=2, portfolio=False))
            if sol.feasible:
                again = simulate(problem, sol.schedule)
                assert again.peak_bytes == sol.predicted_peak_bytes <= budget, (path.name, name)
                assert sol.objective == again.compute_cost >= problem.cost.sum()
            else:
                assert sol.status in ("no_solution", "infeasible") and sol.message, (path.name, name)


def test_chen_sqrt_n_on_a_linear_graph(linear):
    # 17 forward nodes -> every 5th is a checkpoint (4, 9, 14); each segment before a checkpoint is
    # recomputed once for the backward pass (4 nodes each), the last segment is kept.
    problem = linear(16)
    sol = solve(problem, "chen-sqrt-n", 10**6)
    assert sol.objective == 33 + 12
    assert sol.message == "3 checkpoints"


def test_griewank_matches_the_binomial_closed_form():
    """Griewank & Walther (2000): with s = c + 1 snapshots, reversing l steps costs r*l - beta(s+1, r-1)
    forward steps beyond the first sweep's... in this count, l + r*l - C(s+r, r-1), where
    beta(s, r-1) < l <= beta(s, r) and beta(s, r) = C(s+r, s)."""
    for c in range(1, 5):
        for steps in range(2, 60):
            s = c + 1
            r = next(r for r in range(1, steps + 1) if comb(s + r, s) >= steps)
            assert revolve_cost(steps, c)[0] == steps + r * steps - comb(s + r, r - 1), (steps, c)


def test_revolve_schedule_runs_the_optimal_number_of_forward_steps(linear):
    problem = linear(20)
    for slots in (1, 2, 3, 5):
        schedule = revolve_schedule(problem, slots)
        sim = simulate(problem, schedule)
        forward = sum(1 for _, node in schedule if node <= 20)
        assert forward == revolve_cost(21, slots)[0] and sim.num_computes == forward + 20
    assert simulate(problem, revolve_schedule(problem, 2)).peak_bytes < simulate(problem, default_schedule(problem)).peak_bytes


def test_articulation_points_of_a_residual_graph():
    # 0 -> 1 -> 2 -> 3 with a skip 0 -> 2, then 3 -> 4: cut vertices are 2 and 3 (0 and 1 are not).
    problem = Problem.from_edges([1] * 5, [1] * 5, [(0, 1), (1, 2), (0, 2), (2, 3), (3, 4)])
    assert articulation_points(problem) == [2, 3] and not is_linear(problem)
    sol = solve(problem, "chen-sqrt-n", 100)
    assert not sol.feasible and "linear forward graphs only" in sol.message


def test_remat_greedy_respects_the_budget_and_the_optimum(linear):
    problem = linear(6)
    optimum = {4: 18, 5: 16, 6: 15, 7: 14, 8: 13}       # exhaustive optima (test_checkmate)
    for budget, best in optimum.items():
        sol = solve(problem, "remat-greedy", budget)
        if sol.feasible:
            assert sol.predicted_peak_bytes <= budget and sol.objective >= best
        else:
            assert sol.status == "no_solution" and sol.message


SEGMENT_BASELINES = ["chen-sqrt-n", "chen-greedy", "ap-sqrt-n", "ap-greedy", "linearized-sqrt-n", "linearized-greedy"]


@pytest.mark.parametrize("fraction", [0.95, 0.8, 0.6, 0.4])
def test_segment_baselines_cost_at_most_one_extra_forward(benchmark_paths, fraction):
    """Each segment is recomputed once and kept until its backward is done (torch.utils.checkpoint's
    rule): no node runs more than twice and backward nodes run once, whatever the budget."""
    from collections import Counter

    for path in benchmark_paths:
        if "train" not in path.name:
            continue
        problem = Problem.from_node_link(path)
        budget = int(fraction * simulate(problem, default_schedule(problem)).peak_bytes)
        forward_cost = problem.cost[problem.is_recomputable].sum()
        for name in SEGMENT_BASELINES:
            sol = solve(problem, name, budget, SolveOptions(time_limit=5))
            if not sol.feasible:
                continue
            runs = Counter(node for kind, node, *_ in sol.schedule if kind == "compute")
            assert max(runs.values()) <= 2, (path.name, name)
            assert all(runs[n] == 1 for n in range(problem.num_nodes) if not problem.is_recomputable[n]), (path.name, name)
            assert sol.objective <= problem.cost.sum() + forward_cost + 1e-9, (path.name, name)
