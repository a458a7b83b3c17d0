from collections import deque

import numpy as np
import pytest

from memplan.tasks.solve import solve
from memplan.tasks.solve.core.remat_milp import assignment_from_schedule, build_model
from memplan.tasks.solve.core.checkpoints import schedule_from_checkpoints
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import default_schedule, simulate
from memplan.tasks.solve.core.solution import SolveOptions

EXACT = SolveOptions(gap=1e-6, params={"warm_start": "none"})


def exhaustive_optimum(n: int, budget: int, work: list[int] | None = None) -> int | None:
    """Fewest computations of Checkmate's linear graph (2n+1 unit nodes) within `budget` values, over
    ALL schedules: 0-1 BFS over (nodes computed so far, resident set); computing node j costs 1 and holds
    the resident values, its output and its workspace `work[j]` (default 0); freeing a value costs 0."""
    size = 2 * n + 1
    work = work or [0] * size
    deps = [0] * size
    for i in range(size - 1):
        deps[i + 1] |= 1 << i
    for i in range(n):
        deps[2 * n - i] |= 1 << i
    dist = {(0, 0): 0}
    queue = deque([(0, 0)])
    while queue:
        frontier, resident = queue.popleft()
        d = dist[(frontier, resident)]
        if frontier == size:
            return d
        moves = []
        rest = resident
        while rest:
            bit = rest & -rest
            rest ^= bit
            moves.append((0, frontier, resident ^ bit))
        for j in range(min(frontier + 1, size)):
            if (not resident >> j & 1 and not deps[j] & ~resident
                    and bin(resident).count("1") + 1 + work[j] <= budget):
                moves.append((1, frontier + (j == frontier), resident | 1 << j))
        for cost, f, r in moves:
            if d + cost < dist.get((f, r), 1 << 30):
                dist[(f, r)] = d + cost
                (queue.appendleft if cost == 0 else queue.append)((f, r))
    return None


@pytest.mark.parametrize("n", range(1, 8))
def test_ilp_finds_the_exhaustive_optimum_on_linear_graphs(n, linear):
    problem = linear(n)
    for budget in range(1, 2 * n + 3):
        expected = exhaustive_optimum(n, budget)
        got = solve(problem, "checkmate", budget, EXACT)
        if expected is None:
            assert got.status == "infeasible" and got.min_budget_lower_bound > budget
        else:
            assert got.status == "optimal", (n, budget, got.message)
            assert got.objective == expected and got.predicted_peak_bytes <= budget
            assert got.bound == pytest.approx(expected)


def test_paper_formulation_agrees_with_tight(linear):
    problem = linear(4)
    for budget in range(3, 11):
        paper = solve(problem, "checkmate", budget, SolveOptions(params={"warm_start": "none", "formulation": "paper"}))
        assert paper.objective == exhaustive_optimum(4, budget)


def test_model_memory_is_the_simulator(benchmark_paths):
    """The assignment of a schedule satisfies the model exactly at the schedule's simulated peak, its
    U maximum is that peak and its objective the simulated cost."""
    for path in benchmark_paths:
        if "random_layered" in path.name and "n100_" not in path.name:
            continue
        problem = Problem.from_node_link(path)
        fwd = [int(v) for v in problem.order if problem.is_recomputable[v]]
        for retain in (True, False):
            schedule = schedule_from_checkpoints(problem, fwd[::3], retain_recomputed=retain)
            sim = simulate(problem, schedule)
            model, L = build_model(problem, sim.peak_bytes)
            x = assignment_from_schedule(problem, L, schedule)
            Ax = model.A @ x
            tol = 1e-9 * (abs(model.A) @ np.abs(x)) + 1e-9
            assert np.all(Ax >= model.row_lower - tol) and np.all(Ax <= model.row_upper + tol), path.name
            assert x[L.u_base:].max() * L.unit == pytest.approx(sim.peak_bytes, rel=1e-9)
            assert model.c @ x * model.objective_scale == pytest.approx(sim.compute_cost, rel=1e-9)
            tighter, L2 = build_model(problem, sim.peak_bytes - 1)
            assert assignment_from_schedule(problem, L2, schedule)[L2.u_base:].max() > tighter.col_upper[-1]


def test_approx_is_feasible_and_bracketed_by_the_optimum(linear):
    problem = linear(5)
    for budget in range(3, 13):
        optimum = exhaustive_optimum(5, budget)
        approx = solve(problem, "checkmate-approx", budget)
        assert approx.bound <= optimum + 1e-6
        if approx.feasible:
            assert approx.objective >= optimum and approx.predicted_peak_bytes <= budget
        else:
            assert approx.status == "no_solution" and approx.message


def test_infeasible_budget_gets_a_lower_bound():
    # x feeds three graph outputs: computing the last one holds x and all three outputs (4 bytes),
    # while every single node needs only 2: the MILP, not the per-node bound, proves 3 infeasible.
    problem = Problem(name="fan", cost=np.ones(4), workspace=np.zeros(4, np.int64),
                      phase=("forward",) * 4, node_inputs=((), (0,), (0,), (0,)), node_outputs=((0,), (1,), (2,), (3,)),
                      value_bytes=np.ones(4, np.int64), value_producer=np.arange(4), outputs=(1, 2, 3),
                      order=np.arange(4))
    for solver in ("checkmate", "checkmate-approx"):
        below = solve(problem, solver, 2)
        assert below.status == "infeasible" and below.min_budget_lower_bound == 3
        tight = solve(problem, solver, 3, EXACT if solver == "checkmate" else SolveOptions(gap=1e-6))
        assert tight.status == "infeasible" and tight.min_budget_lower_bound == 4 and not tight.feasible
    assert solve(problem, "checkmate", 4, EXACT).objective == 4


def test_time_limit_returns_the_incumbent_with_its_gap(benchmark_paths):
    path = next(p for p in benchmark_paths if p.name.startswith("ResNet50") and "train" in p.name)
    problem = Problem.from_node_link(path)
    budget = int(0.8 * simulate(problem, default_schedule(problem)).peak_bytes)
    start = solve(problem, "ap-greedy", budget)
    warm = solve(problem, "checkmate", budget, SolveOptions(time_limit=3, mip_start=start.schedule))
    assert warm.status == "feasible" and warm.predicted_peak_bytes <= budget
    assert warm.objective <= start.objective and warm.bound >= problem.cost.sum() and warm.gap > 0
    cold = solve(problem, "checkmate", budget, SolveOptions(time_limit=2, params={"warm_start": "none"},
                                                            portfolio=False))
    assert cold.status == "no_solution" and cold.schedule is None and "time limit" in cold.message.lower()


def test_warm_start_within_gap_skips_the_milp(benchmark_paths):
    path = next(p for p in benchmark_paths if p.name.startswith("MobileNet") and "train" in p.name)
    problem = Problem.from_node_link(path)
    budget = int(0.8 * simulate(problem, default_schedule(problem)).peak_bytes)
    sol = solve(problem, "checkmate", budget, SolveOptions(gap=0.02))
    assert sol.status == "optimal" and sol.num_variables is None
    assert sol.objective <= 1.02 * problem.cost.sum() and sol.bound == problem.cost.sum()


def test_expensive_solvers_are_never_worse_than_the_cheap_ones(benchmark_paths):
    """With no time to solve its LP, checkmate-approx returns the best cheap schedule (status time_limit,
    source named); checkmate's answer is never costlier than any cheap solver's."""
    from memplan.tasks.solve.core.portfolio import CHEAP

    path = next(p for p in benchmark_paths if p.name.startswith("ResNet50") and "train" in p.name)
    problem = Problem.from_node_link(path)
    budget = int(0.8 * simulate(problem, default_schedule(problem)).peak_bytes)
    cheap = {name: solve(problem, name, budget, SolveOptions(time_limit=30)) for name in CHEAP}
    best = min(s.objective for s in cheap.values() if s.feasible)
    alone = solve(problem, "checkmate-approx", budget, SolveOptions(time_limit=0.5, portfolio=False))
    assert not alone.feasible and alone.status == "no_solution"
    sol = solve(problem, "checkmate-approx", budget, SolveOptions(time_limit=0.5))
    assert sol.status == "time_limit" and sol.objective == best and sol.source in CHEAP
    assert cheap[sol.source].objective == best and sol.report()["source"] == sol.source
    assert simulate(problem, sol.schedule).peak_bytes == sol.predicted_peak_bytes <= budget
