"""The `acg` solver on Problems: the computation graph it cuts out, the re-forward schedule, the
memory-optimal and budgeted modes (torch-free; tests/runtime/test_acg_plans.py runs real models)."""

from __future__ import annotations

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.tasks.solve import solve
from memplan.tasks.solve.acg.forward import SOURCE, forward_graph, reforward_schedule
from memplan.tasks.solve.acg.solver import budgeted, memory_optimal
from memplan.tasks.solve.acg.division import division_tree
from memplan.tasks.solve.core.problem import Problem, ProblemError
from memplan.tasks.solve.core.simulator import default_schedule, simulate
from memplan.tasks.solve.core.solution import SolveOptions


def training_problem(forward_edges, n, nbytes, cost=None, extra_sink=False):
    """Forward nodes 0..n-1 (node n-1 the loss) with `forward_edges`, then the backward pass autodiff
    makes of them: node b_i (ids n.. in reverse) reads the outputs of f_i, of its predecessors and the
    gradients b_j of its successors. With `extra_sink`, forward node n reads node 0 and nothing reads it
    (a running-stat update)."""
    preds = {i: sorted(a for a, b in forward_edges if b == i) for i in range(n)}
    succs = {i: sorted(b for a, b in forward_edges if a == i) for i in range(n)}
    first_backward = n + (1 if extra_sink else 0)
    grad = {i: first_backward + (n - 1 - i) for i in range(n)}
    edges = list(forward_edges) + ([(0, n)] if extra_sink else [])
    for i in range(n):
        edges += [(i, grad[i])] + [(p, grad[i]) for p in preds[i]] + [(grad[s], grad[i]) for s in succs[i]]
    size = first_backward + n
    nb = list(nbytes) + ([1] if extra_sink else []) + [1] * n
    costs = list(cost or [1.0] * n) + ([1.0] if extra_sink else []) + [1.0] * n
    return Problem.from_edges(costs, nb, edges, backward=[v >= first_backward for v in range(size)],
                              terminal=grad[0], name="training")


def chain_problem(n, nbytes=10):
    return training_problem([(i, i + 1) for i in range(n - 1)], n, [nbytes] * n)


def diamond_problem():
    """0 -> {1, 2} -> 3 -> 4 (loss), bytes 5, 20, 30, 10, 1."""
    return training_problem([(0, 1), (0, 2), (1, 3), (2, 3), (3, 4)], 5, [5, 20, 30, 10, 1])


def test_computation_graph_is_the_forward_graph_the_loss_depends_on():
    problem = training_problem([(0, 1), (1, 2)], 3, [4, 5, 6], extra_sink=True)
    fg = forward_graph(problem)
    assert fg.target == 2
    assert fg.dag.labels == (SOURCE, 0, 1, 2)           # the running-stat update (node 3) is no vertex
    assert fg.dag.cost == (0, 4, 5, 6)
    assert [list(s) for s in fg.dag.succs] == [[1], [2], [3], []]


def test_reforward_schedule_recomputes_each_segment_once_before_its_gradients():
    problem = chain_problem(9)
    fg = forward_graph(problem)
    kept = fg.dag.mask_of([SOURCE, 2, 5, 8])
    schedule = reforward_schedule(fg, kept)
    computes = [n for _, n in schedule]
    forward = list(range(9))
    assert computes[:9] == forward                             # the forward pass, once
    assert all(computes.count(n) == 1 for n in (2, 5, 8))      # checkpoints are never recomputed
    assert all(computes.count(n) == 2 for n in (0, 1, 3, 4, 6, 7))
    backward = [n for n in computes if n >= 9]
    assert backward == sorted(backward) and len(backward) == 9
    # segment {6, 7} is re-forwarded right before the first gradient that reads it (b_7)
    assert computes[9:12] == [9, 10, 6] or computes.index(6, 9) < computes.index(11)
    simulate(problem, schedule)                                # valid: every input resident


def test_memory_mode_minimizes_eq_2_and_runs_in_the_simulator():
    problem = chain_problem(16, nbytes=1)
    sol = solve(problem, "acg", 10**6, SolveOptions(params={"mode": "memory"}))
    assert sol.feasible and sol.simulation.peak_bytes == simulate(problem, sol.schedule).peak_bytes
    # the virtual source costs 0 and the loss 1: k of the other 15 unit tensors are checkpoints
    optimum = 1 + min(k + -(-(15 - k) // (k + 1)) for k in range(16))
    assert f"eq. (2) memory {optimum} B" in sol.message


def test_budget_at_the_checkpoint_all_peak_recomputes_nothing():
    problem = diamond_problem()
    peak = simulate(problem, default_schedule(problem))
    sol = solve(problem, "acg", peak.peak_bytes, SolveOptions())
    assert sol.objective == peak.compute_cost


@given(n=st.integers(3, 12), nbytes=st.lists(st.integers(1, 50), min_size=12, max_size=12),
       where=st.floats(0, 1))
@settings(max_examples=60, deadline=None)
def test_budget_mode_never_recomputes_more_than_the_memory_optimum(n, nbytes, where):
    problem = training_problem([(i, i + 1) for i in range(n - 1)] + [(0, n - 1)], n, nbytes[:n])
    fg = forward_graph(problem)
    root = division_tree(fg.dag)
    optimum = simulate(problem, reforward_schedule(fg, memory_optimal(fg, root).checkpoints))
    top = simulate(problem, default_schedule(problem)).peak_bytes
    budget = int(optimum.peak_bytes + where * (top - optimum.peak_bytes))
    best, tried = budgeted(fg, root, budget)
    assert best is not None and best.simulation.peak_bytes <= budget
    assert best.simulation.compute_cost <= optimum.compute_cost
    assert tried[0].simulation.peak_bytes == optimum.peak_bytes


def test_budget_below_the_memory_optimum_says_so():
    problem = chain_problem(16)
    memory = solve(problem, "acg", 10**9, SolveOptions(params={"mode": "memory"}))
    sol = solve(problem, "acg", memory.predicted_peak_bytes - 1, SolveOptions())
    assert sol.status == "no_solution"
    assert f"the memory-optimal set (eq. 2) peaks at {memory.predicted_peak_bytes} B" in sol.message


def test_kept_nodes_are_never_recomputed():
    problem = chain_problem(16)
    sol = solve(problem, "acg", 10**9, SolveOptions(params={"mode": "memory", "keep": [3, 4, 5]}))
    computes = [n for _, n in sol.schedule]
    assert all(computes.count(n) == 1 for n in (3, 4, 5))
    with pytest.raises(ProblemError, match="keep names nodes \\[20\\]"):
        solve(problem, "acg", 10**9, SolveOptions(params={"keep": [20]}))


def test_graph_without_backward_keeps_the_default_order():
    problem = Problem.from_edges([1.0] * 4, [1] * 4, [(0, 1), (1, 2), (2, 3)])
    sol = solve(problem, "acg", 10**6, SolveOptions())
    assert sol.schedule == default_schedule(problem) and "no backward pass" in sol.message


def test_time_limit_while_dividing_is_reported():
    graph = nx.gnp_random_graph(40, 0.3, seed=1, directed=True)
    edges = sorted((a, b) for a, b in graph.edges if a < b) + [(i, i + 1) for i in range(39)]
    problem = training_problem(sorted(set(edges)), 40, [1] * 40)
    sol = solve(problem, "acg", 10**9, SolveOptions(time_limit=0.0))
    assert sol.status == "no_solution" and "time limit" in sol.message


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="options.mode = 'fast': Input should be 'budget' or 'memory'"):
        solve(diamond_problem(), "acg", 10**6, SolveOptions(params={"mode": "fast"}))


def test_same_problem_gives_the_same_schedule():
    problem = diamond_problem()
    budget = simulate(problem, default_schedule(problem)).peak_bytes - 1
    assert len({tuple(solve(problem, "acg", budget, SolveOptions()).schedule or ()) for _ in range(3)}) == 1
