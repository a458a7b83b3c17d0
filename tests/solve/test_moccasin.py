"""MOCCASIN's CP model (tasks/solve/moccasin.py) against independent optima: the exhaustive search over
all schedules of Checkmate's linear graph, a closed form, and Checkmate's MILP on a random DAG."""

from dataclasses import replace

import numpy as np
import pytest

from memplan.tasks.solve import solve
from memplan.tasks.solve.moccasin import MoccasinOptions, moccasin
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import simulate
from memplan.tasks.solve.core.solution import SolveOptions

from .test_checkmate import exhaustive_optimum

pytest.importorskip("ortools")


def exact(copies: int) -> SolveOptions:
    return SolveOptions(gap=0.0, threads=1, time_limit=60, portfolio=False,
                        params=MoccasinOptions(max_copies=copies, order="default"))


def check(problem: Problem, budget: int, sol) -> None:
    """The schedule runs in the simulator within the budget at the reported cost."""
    assert sol.feasible
    sim = simulate(problem, sol.schedule)
    assert sim.peak_bytes == sol.predicted_peak_bytes <= budget
    assert sim.compute_cost == sol.objective


def test_equals_the_exhaustive_optimum_on_a_linear_graph(linear):
    n = 3
    problem = linear(n)
    for budget in range(3, n + 4):
        sol = moccasin(problem, budget, exact(n))
        check(problem, budget, sol)
        assert sol.status == "optimal"
        assert sol.objective == exhaustive_optimum(n, budget) == pytest.approx(sol.bound)


@pytest.mark.parametrize("n", [3, 4])
def test_closed_forms_on_linear_graphs(n, linear):
    """Eager peak n+2 values: no recomputation at n+2 (2n+1), one recomputation at n+1 (2n+2), and at the
    least budget, 3 values, every backward node recomputes its prefix: (n+1)(n+2)/2."""
    problem = linear(n)
    for budget, cost in ((n + 2, 2 * n + 1), (n + 1, 2 * n + 2), (3, (n + 1) * (n + 2) // 2)):
        sol = moccasin(problem, budget, exact(n))
        check(problem, budget, sol)
        assert sol.objective == cost, budget


def test_equals_checkmates_optimum_on_a_random_dag():
    """Both search the frontier-advancing schedules of the default order; with enough copies per node
    their optima are equal."""
    rng = np.random.default_rng(3)
    n = 7
    edges = [(i, i + 1) for i in range(n - 1)] + [(i, j) for i in range(n) for j in range(i + 2, n) if rng.random() < 0.3]
    problem = Problem.from_edges(rng.integers(1, 9, n).astype(float), rng.integers(1, 6, n), edges)
    eager = simulate(problem, [("compute", v) for v in range(n)]).peak_bytes
    for budget in range(eager, 0, -2):
        cm = solve(problem, "checkmate", budget, SolveOptions(gap=0.0, portfolio=False, params={"warm_start": "none"}))
        mc = moccasin(problem, budget, exact(n))
        assert mc.status == ("infeasible" if cm.status == "infeasible" else "optimal"), budget
        if cm.feasible:
            check(problem, budget, mc)
            assert mc.objective == cm.objective, budget


def test_fewer_copies_can_only_cost_more(linear):
    problem = linear(4)
    one = moccasin(problem, 6, exact(1))
    assert one.objective == 9                      # the eager schedule fits
    assert moccasin(problem, 5, exact(1)).status == "infeasible"
    assert moccasin(problem, 5, exact(2)).objective == 10


def test_a_fitting_start_outside_the_model_is_returned_when_the_model_has_none(linear):
    """With one copy per node nothing fits budget 5 in the model; a start that recomputes (two copies)
    fits, cannot be a hint, and is the answer rather than 'infeasible'."""
    problem = linear(4)
    start = moccasin(problem, 5, exact(2)).schedule
    sol = moccasin(problem, 5, replace(exact(1), mip_start=start))
    check(problem, 5, sol)
    assert sol.status == "feasible" and sol.schedule == start and sol.objective == 10


def test_portfolio_answer_is_never_worse_than_the_cheap_solvers(benchmark_paths):
    path = next(p for p in benchmark_paths if p.name.startswith("VGG16") and "train" in p.name)  # lower bound 0.83
    problem = Problem.from_node_link(path)
    budget = int(0.9 * simulate(problem, [("compute", int(v)) for v in problem.order]).peak_bytes)
    ours = solve(problem, "moccasin", budget, SolveOptions(time_limit=5, threads=1))
    cheap = solve(problem, "remat-greedy", budget)
    check(problem, budget, ours)
    assert ours.objective <= cheap.objective


def test_equals_checkmate_with_multi_output_nodes_workspace_and_graph_inputs():
    """Operator-graph features: a parameter (graph input), nodes with two outputs, workspace, a value no
    one reads and two graph outputs."""
    problem = Problem(
        name="multi", cost=np.array([2.0, 3.0, 1.0, 2.0, 2.0, 1.0]), workspace=np.array([0, 2, 0, 1, 0, 0]),
        phase=("forward", "forward", "loss", "backward", "backward", "backward"),
        node_inputs=((), (1, 0), (2, 3), (4, 1), (5, 2), (6, 3)),
        node_outputs=((1, 2), (3,), (4,), (5, 6), (7,), (8, 9)),
        value_bytes=np.array([5, 3, 2, 4, 1, 2, 2, 1, 1, 3]),
        value_producer=np.array([-1, 0, 0, 1, 2, 3, 3, 4, 5, 5]), outputs=(7, 8), order=np.arange(6))
    eager = simulate(problem, [("compute", v) for v in range(6)]).peak_bytes
    for budget in range(eager, 10, -1):
        cm = solve(problem, "checkmate", budget, SolveOptions(gap=0.0, portfolio=False, params={"warm_start": "none"}))
        mc = moccasin(problem, budget, exact(6))
        assert mc.status == cm.status, budget
        if cm.feasible:
            check(problem, budget, mc)
            assert mc.objective == cm.objective, budget
