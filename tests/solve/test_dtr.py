"""DTR run offline (tasks/solve/dtr.py): valid schedules never cheaper than an exhaustive optimum over all
schedules, a hand-checked chain, no recomputation at the eager peak, a clear answer below any schedule."""

from __future__ import annotations

import heapq

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.tasks.solve import solve
from memplan.tasks.solve.dtr import dtr_schedule
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import default_schedule, simulate
from memplan.tasks.solve.core.solution import min_budget_lower_bound

from tests.solve.test_checkmate import exhaustive_optimum


def cheapest_schedule_cost(problem: Problem, budget: int) -> float | None:
    """Least compute cost over ALL schedules of a one-value-per-node graph (Problem.from_edges) within
    `budget`: Dijkstra over resident sets; freeing costs 0; computing node j (inputs resident) costs
    cost[j] and holds the other resident values plus its output; done when the graph outputs are resident."""
    n = problem.num_nodes
    deps = [sum(1 << v for v in problem.node_inputs[j]) for j in range(n)]
    goal = sum(1 << v for v in problem.outputs)
    size = lambda mask: int(sum(int(problem.value_bytes[v]) for v in range(n) if mask >> v & 1))  # noqa: E731
    best = {0: 0.0}
    heap = [(0.0, 0)]
    while heap:
        d, resident = heapq.heappop(heap)
        if d > best[resident]:
            continue
        if resident & goal == goal:
            return d
        moves = [(0.0, resident ^ (1 << v)) for v in range(n) if resident >> v & 1]
        for j in range(n):
            if deps[j] & ~resident == 0 and size(resident & ~(1 << j)) + int(problem.value_bytes[j]) <= budget:
                moves.append((float(problem.cost[j]), resident | 1 << j))
        for c, state in moves:
            if d + c < best.get(state, float("inf")):
                best[state] = d + c
                heapq.heappush(heap, (d + c, state))
    return None


@st.composite
def small_dags(draw) -> Problem:
    n = draw(st.integers(2, 8))
    edges = [(i, j) for j in range(1, n) for i in range(j) if draw(st.booleans())]
    edges += [(j - 1, j) for j in range(1, n) if (j - 1, j) not in edges and draw(st.booleans())]
    cost = draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    nbytes = draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))
    backward = [j >= n - draw(st.integers(0, n // 2)) for j in range(n)]
    return Problem.from_edges(cost, nbytes, edges, backward=backward, name="dag")


@settings(max_examples=25, deadline=None)
@given(small_dags(), st.floats(0.0, 1.0))
def test_valid_and_never_below_the_exhaustive_optimum(problem, fraction):
    eager = simulate(problem, default_schedule(problem)).peak_bytes
    lower = min_budget_lower_bound(problem)
    budget = int(lower + fraction * (eager - lower))
    sol = solve(problem, "dtr", budget)
    optimum = cheapest_schedule_cost(problem, budget)
    if not sol.feasible:
        assert sol.status == "no_solution" and sol.message
        return
    again = simulate(problem, sol.schedule)
    assert again.peak_bytes == sol.predicted_peak_bytes <= budget
    assert optimum is not None and sol.objective >= optimum - 1e-9
    recomputed = [node for kind, node in sol.schedule if kind == "compute"]
    assert all(problem.is_recomputable[node] for node in set(recomputed) if recomputed.count(node) > 1)


def test_chain_with_one_recompute():
    """a -> b -> c -> d, d also reads a; bytes 1, 2, 2, 1, costs 1, 2, 4, 8. Eager peak 5 (a, b, c at c's
    step). At budget 4 (what c and d each need alone) a must be dropped for c and recomputed for d: the
    only alternative is the eager schedule, so the optimum is 15 + 1."""
    problem = Problem.from_edges([1, 2, 4, 8], [1, 2, 2, 1], [(0, 1), (1, 2), (2, 3), (0, 3)])
    assert simulate(problem, default_schedule(problem)).peak_bytes == 5
    assert min_budget_lower_bound(problem) == 4
    sol = solve(problem, "dtr", 4)
    assert sol.feasible and sol.objective == 16 and sol.predicted_peak_bytes == 4
    assert [s for s in sol.schedule if s[0] == "compute"] == [("compute", n) for n in (0, 1, 2, 0, 3)]
    assert cheapest_schedule_cost(problem, 4) == 16


def test_linear_graphs_against_the_exhaustive_optimum(linear):
    for n in (3, 4):
        problem = linear(n)
        for budget in range(1, 2 * n + 3):
            expected = exhaustive_optimum(n, budget)
            sol = solve(problem, "dtr", budget)
            if expected is None:
                assert sol.status == "infeasible" and sol.min_budget_lower_bound > budget
            elif sol.feasible:
                assert sol.objective >= expected and sol.predicted_peak_bytes <= budget


def test_no_recomputation_at_the_eager_peak(linear):
    problem = linear(6)
    peak = simulate(problem, default_schedule(problem)).peak_bytes
    sol = solve(problem, "dtr", peak)
    assert sol.objective == problem.cost.sum() and sol.predicted_peak_bytes <= peak


def test_below_any_schedule_is_infeasible_with_the_bound():
    problem = Problem.from_edges([1, 1, 1], [3, 5, 2], [(0, 1), (1, 2)])
    sol = solve(problem, "dtr", 7)
    assert sol.status == "infeasible" and sol.min_budget_lower_bound == 8 and "8 bytes" in sol.message
    assert dtr_schedule(problem, 7) is None


def test_graph_outputs_and_backward_values_are_never_evicted(linear):
    problem = linear(5)
    sol = solve(problem, "dtr", 4)
    assert sol.feasible
    freed = {value for kind, value in sol.schedule if kind == "free"}
    assert not freed & set(problem.outputs)
    computed = [node for kind, node in sol.schedule if kind == "compute"]
    assert all(computed.count(node) == 1 for node in np.flatnonzero(~problem.is_recomputable))


def test_operator_graphs_with_variants_inputs_and_backward_nodes():
    """A training step (tests/solve/test_monet.masked_chain): a batch input, ReLU-mask variants (dtr also
    plans with them fixed), backward nodes and two graph outputs. Every answer is valid, runs each
    backward node once, never frees a graph output, and at the eager peak recomputes nothing and runs no
    (costlier) variant."""
    from tests.solve.test_monet import masked_chain

    for seed in (4, 9):
        problem = masked_chain(seed, n=5)
        plain = problem.without_variants()
        eager = simulate(plain, default_schedule(plain)).peak_bytes
        lower = min_budget_lower_bound(plain)
        for budget in sorted({lower, (lower + eager) // 2, eager}):
            sol = solve(problem, "dtr", budget)
            if budget == eager:
                assert sol.objective == plain.cost.sum()
            if not sol.feasible:
                assert sol.status == "no_solution" and sol.message
                continue
            assert simulate(problem, sol.schedule).peak_bytes == sol.predicted_peak_bytes <= budget
            computed = [step[1] for step in sol.schedule if step[0] == "compute"]
            assert all(computed.count(node) == 1 for node in np.flatnonzero(~plain.is_recomputable))
            assert not {step[1] for step in sol.schedule if step[0] == "free"} & set(plain.outputs)
