"""Budgets at which each heuristic must return a plan, computed independently from the solver's own
definition (its checkpoint sets, simulated) or from the exhaustive optimum; and Checkmate with
workspace, whose memory constraint must charge it."""

from __future__ import annotations

import math
from dataclasses import replace

import networkx as nx
import numpy as np
import pytest

from memplan.tasks.solve import solve
from memplan.tasks.solve.baselines import revolve_schedule
from memplan.tasks.solve.core.checkpoints import schedule_from_checkpoints
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import default_schedule, simulate
from memplan.tasks.solve.core.solution import SolveOptions

from .test_checkmate import exhaustive_optimum


def linear_graph(n: int, nbytes=None, workspace=None) -> Problem:
    """Checkmate's linear training graph: forward nodes 0..n (n the loss), backward n+1..2n."""
    size = 2 * n + 1
    edges = [(i, i + 1) for i in range(size - 1)] + [(i, 2 * n - i) for i in range(n)]
    problem = Problem.from_edges([1.0] * size, nbytes or [1] * size, edges,
                                 backward=[i > n for i in range(size)], name=f"linear{n}")
    if workspace is not None:
        problem = replace(problem, workspace=np.asarray(workspace, dtype=np.int64))
    return problem


def outputs(problem, nodes):
    return [v for n in nodes for v in problem.node_outputs[n]]


def measure(problem, kept_nodes):
    sim = simulate(problem, schedule_from_checkpoints(problem, outputs(problem, kept_nodes)))
    return sim.compute_cost, sim.peak_bytes


def assert_plan_exactly_from(problem, solver, budget, cost):
    """`solver` returns a plan of cost `cost` at `budget` and none one byte below (a fixed schedule)."""
    sol = solve(problem, solver, budget, SolveOptions())
    assert sol.feasible, (solver, budget, sol.message)
    assert sol.objective == cost and sol.predicted_peak_bytes == budget
    assert solve(problem, solver, budget - 1, SolveOptions()).status == "no_solution"


BYTES = [3, 9, 4, 12, 2, 7, 5, 11, 6]


@pytest.mark.parametrize("n", [3, 5, 8])
def test_checkpoint_all_fits_exactly_its_own_peak(n):
    problem = linear_graph(n, [BYTES[i % 9] for i in range(2 * n + 1)])
    peak = simulate(problem, default_schedule(problem)).peak_bytes
    assert_plan_exactly_from(problem, "checkpoint-all", peak, 2 * n + 1)


@pytest.mark.parametrize("n", [3, 5, 8])
def test_sqrt_n_baselines_fit_the_peak_of_their_own_checkpoints(n):
    """Chen's sqrt(n): of the m candidates, every ceil(sqrt(m))-th is kept. Linear graph: the candidates
    are the forward nodes 0..n (chen, linearized) or the articulation points 1..n-1 (ap)."""
    problem = linear_graph(n, [BYTES[i % 9] for i in range(2 * n + 1)])
    forward = list(range(n + 1))
    interior = list(range(1, n))
    for solver, candidates in (("chen-sqrt-n", forward), ("linearized-sqrt-n", forward), ("ap-sqrt-n", interior)):
        stride = math.ceil(math.sqrt(len(candidates)))
        cost, peak = measure(problem, candidates[stride - 1::stride])
        assert_plan_exactly_from(problem, solver, peak, cost)


@pytest.mark.parametrize("n", [3, 6])
def test_griewank_fits_the_peak_of_its_revolve_schedule(n):
    problem = linear_graph(n, [BYTES[i % 9] for i in range(2 * n + 1)])
    slots = math.ceil(math.log2(n + 1))
    sim = simulate(problem, revolve_schedule(problem, slots))
    assert_plan_exactly_from(problem, "griewank-log-n", sim.peak_bytes, sim.compute_cost)


def greedy_sets(problem, candidates):
    """Chen's greedy for every segment size b of the solver's grid (48 geometric steps from the smallest
    forward output to their sum): accumulate output bytes, keep a candidate once more than b accumulated."""
    forward = [int(v) for v in problem.order if problem.is_recomputable[v]]
    sizes = problem.node_bytes[forward].astype(float)
    sets = set()
    for b in np.geomspace(max(sizes.min(), 1.0), max(sizes.sum(), 2.0), 48):
        kept, acc = [], 0.0
        for node in forward:
            acc += float(problem.node_bytes[node])
            if acc > b and node in candidates:
                kept.append(node)
                acc = 0.0
        sets.add(tuple(kept))
    return [measure(problem, list(kept)) for kept in sets]


def residual_problem():
    """Forward chain 0..6 with skips (0, 2) and (3, 5): articulation points 0, 2, 3, 5 (and 6)."""
    forward_edges = [(i, i + 1) for i in range(6)] + [(0, 2), (3, 5)]
    n = 7
    grad = {i: n + (n - 1 - i) for i in range(n)}
    edges = list(forward_edges)
    for i in range(n):
        preds = [a for a, b in forward_edges if b == i]
        succs = [b for a, b in forward_edges if a == i]
        edges += [(i, grad[i])] + [(p, grad[i]) for p in preds] + [(grad[s], grad[i]) for s in succs]
    nbytes = [8, 3, 10, 6, 9, 4, 2] + [1] * n
    return Problem.from_edges([1.0] * 2 * n, nbytes, edges, backward=[v >= n for v in range(2 * n)],
                              terminal=grad[0], name="residual")


@pytest.mark.parametrize("solver, graph", [          # chen-greedy applies to linear graphs only
    ("chen-greedy", "linear"), ("linearized-greedy", "linear"), ("ap-greedy", "linear"),
    ("linearized-greedy", "residual"), ("ap-greedy", "residual")])
def test_greedy_baselines_return_the_cheapest_of_their_own_sets(solver, graph):
    problem = linear_graph(7, [BYTES[i % 9] for i in range(15)]) if graph == "linear" else residual_problem()
    forward = [int(v) for v in problem.order if problem.is_recomputable[v]]
    undirected = nx.Graph()
    undirected.add_nodes_from(forward)
    undirected.add_edges_from((a, b) for a in forward for b in forward if a < b and any(
        problem.value_producer[v] == a for v in problem.node_inputs[b]))
    candidates = set(nx.articulation_points(undirected)) if solver == "ap-greedy" else set(forward)
    points = greedy_sets(problem, candidates)
    peaks = sorted({peak for _, peak in points})
    for budget in [peaks[0] - 1, *peaks]:
        expected = min((cost for cost, peak in points if peak <= budget), default=None)
        sol = solve(problem, solver, budget, SolveOptions())
        if expected is None:
            assert sol.status == "no_solution", (solver, budget)
        else:
            assert sol.feasible and sol.objective == expected, (solver, budget, sol.message)


@pytest.mark.parametrize("solver", ["remat-greedy", "checkmate-approx", "acg"])
@pytest.mark.parametrize("workspace", [False, True])
def test_memory_aware_heuristics_return_checkpoint_all_at_its_peak(solver, workspace):
    """At the checkpoint-all peak, no recomputation is needed: remat-greedy starts there; Checkmate's LP
    relaxation with positive costs runs each node once (R = I), its S is then forced to 1 on every
    value's span and can only decrease after it, so two-phase rounding at any threshold recomputes
    nothing; ACG keeps every vertex."""
    size = 11
    problem = linear_graph(5, [BYTES[i % 9] for i in range(size)],
                           [(7 * i) % 5 * 3 if workspace else 0 for i in range(size)])
    peak = simulate(problem, default_schedule(problem)).peak_bytes
    for budget in (peak, 2 * peak):
        sol = solve(problem, solver, budget, SolveOptions())
        assert sol.feasible, (solver, budget, sol.message)
        assert sol.objective == size and sol.predicted_peak_bytes == peak
        assert sol.source is None, sol.message          # its own schedule, not a cheap solver's (portfolio)


@pytest.mark.parametrize("n, node, amount", [(4, 6, 3), (5, 2, 2), (5, 7, 4)])
def test_checkmate_charges_each_nodes_workspace(n, node, amount):
    """A workspace on one node (and 1 B on the first forward node): the MILP optimum is the exhaustive
    optimum of the same memory model at every budget, and no schedule exists where none does."""
    size = 2 * n + 1
    work = [0] * size
    work[node], work[1] = amount, 1
    problem = linear_graph(n, workspace=work)
    for budget in range(1, 2 * n + 6):
        expected = exhaustive_optimum(n, budget, work)
        got = solve(problem, "checkmate", budget, SolveOptions(gap=1e-6, params={"warm_start": "none"}))
        if expected is None:
            assert not got.feasible, (n, budget)
        else:
            assert got.status == "optimal", (n, budget, got.message)
            assert got.objective == expected and got.predicted_peak_bytes <= budget, (n, budget)
