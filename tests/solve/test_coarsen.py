"""Chain coarsening (tasks/solve/core/coarsen.py): expanded schedules run in the simulator within the coarse
peak at the coarse cost, the coarse optimum bounds the fine one from above, and on a graph of
conv -> relu layers it equals the fine optimum wherever the coarse problem is feasible."""

import numpy as np
import pytest

from memplan.tasks.solve import solve
from memplan.tasks.solve.core.coarsen import chains, coarsen
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import default_schedule, simulate
from memplan.tasks.solve.core.solution import SolveOptions

EXACT = SolveOptions(gap=0.0, portfolio=False, params={"warm_start": "none"})


def conv_relu_graph(n: int, conv_bytes: int) -> Problem:
    """n forward layers conv_i -> relu_i (conv_i's output read by relu_i alone, relu_i's by the next conv
    and by the gradient of layer i), a loss, and a chain of n gradient nodes."""
    names, cost, nbytes, backward, edges = [], [], [], [], []

    def node(name: str, c: float, b: int, bwd: bool = False) -> int:
        names.append(name), cost.append(c), nbytes.append(b), backward.append(bwd)
        return len(names) - 1

    prev, relus = None, []
    for i in range(n):
        conv = node(f"conv{i}", 3.0, conv_bytes)
        if prev is not None:
            edges.append((prev, conv))
        relu = node(f"relu{i}", 1.0, 1)
        edges.append((conv, relu))
        relus.append(relu)
        prev = relu
    grad = node("loss", 1.0, 1)
    edges.append((prev, grad))
    for i in reversed(range(n)):
        g = node(f"grad{i}", 2.0, 1, True)
        edges += [(grad, g), (relus[i], g)]
        grad = g
    return Problem.from_edges(cost, nbytes, edges, backward=backward, names=names)


def test_chains_merge_single_reader_single_producer_links_only():
    problem = conv_relu_graph(3, 2)
    merged = [[problem.node_names[v] for v in c] for c in chains(problem) if len(c) > 1]
    # conv_i's output is read by relu_i alone: merged; relu_i's is also read by grad_i, and grad_i reads
    # two made values: neither extends a chain
    assert merged == [["conv0", "relu0"], ["conv1", "relu1"], ["conv2", "relu2"]]
    assert all(problem.phase[c[0]] == problem.phase[c[-1]] for c in chains(problem))
    c = coarsen(problem)
    assert sorted(v for g in c.members for v in g) == list(range(problem.num_nodes))


@pytest.mark.parametrize("conv_bytes", [1, 2])
def test_coarse_optimum_bounds_and_here_equals_the_fine_optimum(conv_bytes):
    problem = conv_relu_graph(4, conv_bytes)
    c = coarsen(problem)
    assert c.problem.num_nodes < problem.num_nodes
    eager = simulate(problem, default_schedule(problem)).peak_bytes
    solved = 0
    for budget in range(eager, 2, -1):
        fine = solve(problem, "checkmate", budget, EXACT)
        coarse = solve(c.problem, "checkmate", budget, EXACT)
        if not coarse.feasible:
            continue
        solved += 1
        expanded = simulate(problem, c.expand(coarse.schedule))
        assert expanded.peak_bytes <= coarse.predicted_peak_bytes <= budget
        assert expanded.compute_cost == coarse.objective
        assert fine.status == "optimal" and fine.objective <= coarse.objective
        assert fine.objective == coarse.objective, budget
    assert solved >= 2


def test_coarsen_option_returns_a_checked_fine_schedule():
    problem = conv_relu_graph(4, 2)
    budget = simulate(problem, default_schedule(problem)).peak_bytes - 1
    for solver, params in (("checkmate", {"coarsen": True, "warm_start": "none"}),
                           ("moccasin", {"coarsen": True, "max_copies": 4, "order": "default"})):
        sol = solve(problem, solver, budget, SolveOptions(gap=0.0, portfolio=False, params=params))
        assert sol.feasible and "coarse nodes" in sol.message
        sim = simulate(problem, sol.schedule)
        assert sim.peak_bytes == sol.predicted_peak_bytes <= budget and sim.compute_cost == sol.objective
        assert sol.bound == problem.cost.sum()
        assert sol.objective == solve(problem, "checkmate", budget, EXACT).objective


def test_expand_preserves_cost_and_never_raises_the_peak_on_benchmark_graphs(benchmark_paths):
    """Forward-only benchmark graphs collapse to a few nodes; the eager coarse schedule expands to the
    eager fine one's cost within the coarse peak."""
    for path in benchmark_paths:
        if "_test" not in path.name:
            continue
        problem = Problem.from_node_link(path)
        c = coarsen(problem)
        coarse = simulate(c.problem, default_schedule(c.problem))
        expanded = simulate(problem, c.expand(default_schedule(c.problem)))
        assert expanded.peak_bytes <= coarse.peak_bytes and np.isclose(expanded.compute_cost, coarse.compute_cost)
        assert np.isclose(expanded.compute_cost, problem.cost.sum())
