"""`acg` in budget mode against a brute force over its own family: every checkpoint set (source, loss and
kept vertices always in), each scheduled by the re-forward schedule and simulated. Exact on small
families; the Lagrangian heuristic that larger families get fits the budget and beats the memory
optimum where its multiplier search finds a cheaper hull point."""

from __future__ import annotations

import importlib
import importlib.util
import random
from pathlib import Path

import numpy as np
import pytest

from memplan.tasks.solve import solve
from memplan.tasks.solve.acg.division import division_tree
from memplan.tasks.solve.acg.forward import forward_graph, reforward_schedule
from memplan.tasks.solve.acg.solver import budgeted, memory_optimal
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import default_schedule, simulate
from memplan.tasks.solve.core.solution import SolveOptions

_spec = importlib.util.spec_from_file_location("acg_solver_tests", Path(__file__).with_name("test_acg_solver.py"))
_helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_helpers)
training_problem = _helpers.training_problem


def family(problem, keep=()):
    """(compute cost, peak) of every checkpoint set of the ACG family of `problem`."""
    fg = forward_graph(problem, keep=keep)
    dag = fg.dag
    fixed = (1 << dag.source) | (1 << dag.target) | dag.forced
    free = [v for v in range(dag.n) if not fixed >> v & 1]
    out = []
    for m in range(1 << len(free)):
        mask = fixed | sum(1 << free[i] for i in range(len(free)) if m >> i & 1)
        sim = simulate(problem, reforward_schedule(fg, mask))
        out.append((sim.compute_cost, sim.peak_bytes))
    return out


def brute_force(points, budget):
    """The least compute cost of a set whose simulated peak fits `budget` (None: none fits)."""
    return min((cost for cost, peak in points if peak <= budget), default=None)


def skip_chain(nbytes, skips=((0, -1),)):
    n = len(nbytes)
    edges = {(i, i + 1) for i in range(n - 1)} | {(a % n, b % n) for a, b in skips}
    return training_problem(sorted(edges), n, nbytes)


def test_the_issue_example_finds_the_brute_force_optimum():
    """7-node chain with skip edge (0, 6), budget 180: the Lagrangian search stopped at cost 17."""
    problem = skip_chain([49, 27, 3, 17, 33, 32, 26])
    assert brute_force(family(problem), 180) == 15.0
    sol = solve(problem, "acg", 180, SolveOptions())
    assert sol.feasible and sol.objective == 15.0 and sol.predicted_peak_bytes <= 180
    assert "exact search over the 64 checkpoint sets" in sol.message
    lagrangian = solve(problem, "acg", 180, SolveOptions(params={"exact_limit": 0}))
    assert lagrangian.objective == 17.0 and "exact search" not in lagrangian.message
    checkmate = solve(problem, "checkmate", 180, SolveOptions())
    assert checkmate.objective == 15.0


def _random_cases(count, seed):
    rng = random.Random(seed)
    for _ in range(count):
        n = rng.randint(3, 7)
        nbytes = [rng.randint(1, 50) for _ in range(n)]
        skips = {(a, rng.randint(a + 2, n - 1)) for a in range(n - 2) if rng.random() < 0.4}
        yield nbytes, tuple(sorted(skips)), rng.random()


@pytest.mark.parametrize("nbytes, skips, where", list(_random_cases(24, seed=17)))
def test_budget_mode_is_the_brute_force_optimum_of_its_family(nbytes, skips, where):
    problem = skip_chain(nbytes, skips)
    points = family(problem)
    lowest = min(peak for _, peak in points)
    top = simulate(problem, default_schedule(problem)).peak_bytes
    for budget in sorted({lowest - 1, lowest, int(lowest + where * (top - lowest)), top}):
        sol = solve(problem, "acg", budget, SolveOptions())
        best = brute_force(points, budget)
        if best is None:
            assert sol.status == "no_solution", (budget, sol.message)
        else:
            assert sol.feasible and sol.predicted_peak_bytes <= budget, (budget, sol.message)
            assert sol.objective == best, (budget, sol.message)


def test_kept_vertices_stay_checkpoints_in_the_exact_search():
    problem = skip_chain([30, 5, 40, 8, 25, 12])
    points = family(problem, keep=[2])
    budget = sorted({peak for _, peak in points})[1]
    sol = solve(problem, "acg", budget, SolveOptions(params={"keep": [2]}))
    assert sol.objective == brute_force(points, budget)
    assert [n for _, n in sol.schedule].count(2) == 1
    assert "exact search over the 16 checkpoint sets" in sol.message


def test_the_time_limit_stops_both_searches_with_the_best_fitting_set_so_far(monkeypatch):
    """Past the deadline (the division tree is built regardless here) the bisection evaluates only its
    two end points and the exact search nothing; the fitting one is returned and the message says so."""
    monkeypatch.setattr(importlib.import_module("memplan.tasks.solve.acg.solver"), "division_tree",
                        lambda dag, deadline=None: division_tree(dag))
    problem = skip_chain([49, 27, 3, 17, 33, 32, 26])
    top = simulate(problem, default_schedule(problem))
    sol = solve(problem, "acg", top.peak_bytes, SolveOptions(time_limit=0.0))
    assert sol.feasible and sol.objective == top.compute_cost
    assert sol.message.startswith("Lagrangian search: 2 checkpoint sets simulated")
    assert "exact search over the 64 checkpoint sets: 0 simulated, stopped by the time limit" in sol.message
    chain = training_problem([(i, i + 1) for i in range(13)], 14, [(7 * i * i + 3) % 41 + 5 for i in range(14)])
    budget = simulate(chain, default_schedule(chain)).peak_bytes - 15
    searched = solve(chain, "acg", budget, SolveOptions(params={"exact_limit": 0}))
    assert searched.message.startswith("Lagrangian search: 3 checkpoint sets simulated")
    stopped = solve(chain, "acg", budget, SolveOptions(time_limit=0.0, params={"exact_limit": 0}))
    assert stopped.feasible and stopped.message.startswith("Lagrangian search: 2 checkpoint sets simulated")
    finished = solve(problem, "acg", top.peak_bytes, SolveOptions(time_limit=None))
    assert finished.objective == top.compute_cost and "1 simulated; chose 8 checkpoints" in finished.message


def test_the_family_size_counts_only_the_vertices_that_may_be_recomputed():
    """8 vertices (the virtual source, nodes 0..6); the source and the loss (node 6) are always kept, so
    keeping node 0 halves the family and keeping the loss changes nothing. `exact_limit` is inclusive."""
    problem = skip_chain([49, 27, 3, 17, 33, 32, 26])
    for keep, size in (([0], 32), ([6], 64), ([0, 3], 16)):
        assert len(family(problem, keep)) == size
        sol = solve(problem, "acg", 180, SolveOptions(params={"keep": keep}))
        assert f"exact search over the {size} checkpoint sets" in sol.message, keep
    assert "exact search over the 64" in solve(problem, "acg", 180, SolveOptions(params={"exact_limit": 64})).message
    assert "exact search" not in solve(problem, "acg", 180, SolveOptions(params={"exact_limit": 63})).message


def test_the_bisection_returns_checkpoint_all_at_its_peak_without_searching():
    problem = skip_chain([49, 27, 3, 17, 33, 32, 26])
    fg = forward_graph(problem)
    top = simulate(problem, default_schedule(problem))
    best, tried = budgeted(fg, division_tree(fg.dag), top.peak_bytes)
    assert best.checkpoints == (1 << fg.dag.n) - 1 and best.simulation.compute_cost == top.compute_cost
    assert len(tried) == 2 and tried[0].checkpoints != best.checkpoints


def test_the_lagrangian_search_finds_hull_points_cheaper_than_the_memory_optimum():
    """Larger families: between the memory optimum (mu = 0) and checkpoint-all, the multiplier bisection
    finds cheaper fitting sets; the result always fits and never recomputes more than the memory optimum."""
    nbytes = [(7 * i * i + 3) % 41 + 5 for i in range(14)]
    problem = training_problem([(i, i + 1) for i in range(13)], 14, nbytes)
    fg = forward_graph(problem)
    root = division_tree(fg.dag)
    optimum = simulate(problem, reforward_schedule(fg, memory_optimal(fg, root).checkpoints))
    top = simulate(problem, default_schedule(problem)).peak_bytes
    cheaper = 0
    for budget in range(optimum.peak_bytes, top, 15):
        best, tried = budgeted(fg, root, budget)
        assert best.simulation.peak_bytes <= budget
        assert best.simulation.compute_cost <= optimum.compute_cost
        assert len({c.checkpoints for c in tried}) == len(tried)          # every candidate simulated once
        cheaper += best.simulation.compute_cost < optimum.compute_cost
        sol = solve(problem, "acg", budget, SolveOptions(params={"exact_limit": 0}))
        assert sol.objective == best.simulation.compute_cost
    assert cheaper >= 10


def test_the_exact_search_simulates_the_whole_family_only_when_nothing_fits():
    from memplan.tasks.solve.acg.solver import exhaustive

    problem = skip_chain([49, 27, 3, 17, 33, 32, 26])
    fg = forward_graph(problem)
    best, simulated, finished = exhaustive(fg, 1, None)
    assert (best, simulated, finished) == (None, 64, True)              # 2^6 sets: source and loss fixed
    kept = forward_graph(problem, keep=[3])
    assert exhaustive(kept, 1, None)[1:] == (32, True)


def test_the_exact_search_stops_once_its_lower_bound_passes_the_best_cost():
    """At the checkpoint-all peak, keeping every vertex costs the no-recomputation sum, and every other set
    recomputes a vertex a gradient reads: one simulation proves it optimal."""
    from memplan.tasks.solve.acg.solver import exhaustive

    problem = skip_chain([49, 27, 3, 17, 33, 32, 26])
    fg = forward_graph(problem)
    top = simulate(problem, default_schedule(problem))
    best, simulated, finished = exhaustive(fg, top.peak_bytes, None)
    assert simulated == 1 and finished and best.simulation.compute_cost == top.compute_cost
    assert best.checkpoints == (1 << fg.dag.n) - 1


def test_the_exact_search_returns_at_its_deadline():
    import time

    from memplan.tasks.solve.acg.solver import exhaustive

    fg = forward_graph(skip_chain([49, 27, 3, 17, 33, 32, 26]))
    assert exhaustive(fg, 10**9, None, deadline=time.perf_counter()) == (None, 0, False)


def test_solutions_name_acg_and_their_time_in_every_outcome():
    from memplan.tasks.solve.core.problem import Problem

    no_backward = Problem.from_edges([1.0] * 3, [1] * 3, [(0, 1), (1, 2)])
    chainy = skip_chain([5, 6, 7, 8])
    outcomes = [solve(no_backward, "acg", 10**6, SolveOptions()),
                solve(chainy, "acg", 10**6, SolveOptions(time_limit=0.0)),
                solve(chainy, "acg", 10**6, SolveOptions()),
                solve(chainy, "acg", 10**6, SolveOptions(params={"mode": "memory"})),
                solve(chainy, "acg", 1, SolveOptions())]
    assert [s.solver for s in outcomes] == ["acg"] * 5
    assert all(0 < s.solve_seconds < 60 for s in outcomes)
    assert [s.budget_bytes for s in outcomes] == [10**6, 10**6, 10**6, 10**6, 1]
    assert outcomes[0].message == "the graph has no backward pass, so no gradient checkpoint lowers its peak"
    assert outcomes[4].status == "no_solution" and "exact search over the 8 checkpoint sets: 8 simulated" in outcomes[4].message


def sparse_backward_problem(nbytes, skips, times, saves):
    """A skip chain whose backward pass reads only what `saves[i]` names for forward node i: "out" (its
    output, like relu), "in" (its inputs, like a linear layer) or "" (nothing, like an add); b_i always
    reads the gradients of i's successors, and the loss gradient reads the loss. Vertices no gradient
    reads cost nothing extra when not kept, unless their segment's re-forward needs them."""
    n = len(nbytes)
    forward = sorted({(i, i + 1) for i in range(n - 1)} | set(skips))
    grad = {i: n + (n - 1 - i) for i in range(n)}
    edges = list(forward)
    for i in range(n):
        edges += [(grad[b], grad[i]) for a, b in forward if a == i]
        if saves[i] == "out" or i == n - 1:
            edges.append((i, grad[i]))
        elif saves[i] == "in":
            edges += [(a, grad[i]) for a, b in forward if b == i]
    return Problem.from_edges(list(times) + [1.0] * n, list(nbytes) + [1] * n, edges,
                              backward=[v >= n for v in range(2 * n)], terminal=grad[0], name="sparse")


def _sparse_cases(count, seed):
    rng = random.Random(seed)
    for _ in range(count):
        n = rng.randint(4, 7)
        skips = tuple(sorted({(a, rng.randint(a + 2, n - 1)) for a in range(n - 2) if rng.random() < 0.3}))
        yield (tuple(rng.randint(1, 40) for _ in range(n)), skips, tuple(float(rng.randint(1, 4)) for _ in range(n)),
               tuple(rng.choice(["out", "in", ""]) for _ in range(n)))


TIED = ((6, 29, 33, 7, 11, 34, 26), (), (3.0, 4.0, 1.0, 4.0, 1.0, 3.0, 4.0), ("", "out", "out", "", "out", "out", "out"))


@pytest.mark.parametrize("nbytes, skips, times, saves", [TIED, *_sparse_cases(6, seed=5)])
def test_exact_search_when_gradients_read_few_forward_values(nbytes, skips, times, saves):
    """The lower bound charges only vertices a gradient reads, so the search may not skip a set whose
    other vertices are never recomputed. Ties in cost go to the least peak (in `TIED`, at budgets 96 and 130
    the sets of least cost peak differently)."""
    problem = sparse_backward_problem(nbytes, skips, times, saves)
    points = family(problem)
    peaks = sorted({peak for _, peak in points})
    for budget in peaks[::3] + ([96, 130] if nbytes == TIED[0] else []):
        sol = solve(problem, "acg", budget, SolveOptions())
        best = brute_force(points, budget)
        assert sol.objective == best, (budget, sol.message)
        assert sol.predicted_peak_bytes == min(peak for cost, peak in points if cost == best and peak <= budget)


BISECTED = [  # (bytes, compute costs, skip edge from the first node to the loss) of chains
    ([1, 29, 18, 15, 38, 7, 21, 2, 2, 2, 35, 1], [4, 2, 4, 1, 5, 2, 4, 4, 5, 2, 3, 2], False),
    ([8, 20, 7, 28, 16, 33, 36, 14, 22, 22, 33, 26], [5, 4, 1, 2, 4, 5, 5, 5, 5, 5, 1, 3], False),
    ([30, 19, 2, 27, 36, 7, 12, 19, 8, 22, 33, 28], [5, 2, 3, 3, 5, 4, 5, 4, 5, 1, 4, 2], False),
    ([12, 16, 6, 37, 20, 34, 32], [3, 4, 3, 5, 1, 1, 5], True),
    ([30, 3, 20, 25, 24, 22, 29, 11, 7, 1], [1, 3, 1, 3, 4, 1, 5, 2, 4, 3], False),
]


@pytest.mark.parametrize("nbytes, times, skip", BISECTED)
def test_the_bisection_reaches_the_largest_fitting_multiplier(nbytes, times, skip):
    """For each break-even multiplier mu = l(v)/t(v), Algorithm 6 with weights l - mu t (the search module,
    independently of the bisection) gives a set; at a budget where the sets of the smallest k multipliers
    fit and the others do not, the bisection must reach the k-th, so its answer costs at most that set's
    cost; every candidate is simulated once."""
    from memplan.tasks.solve.acg.search import DivisionSearch, acg_checkpoints

    n = len(nbytes)
    edges = [(i, i + 1) for i in range(n - 1)] + ([(0, n - 1)] if skip else [])
    problem = training_problem(edges, n, nbytes, cost=[float(t) for t in times])
    fg = forward_graph(problem)
    root = division_tree(fg.dag)
    lengths = np.asarray(fg.dag.cost, dtype=float)
    sets = []
    for mu in sorted({float(length / t) for length, t in zip(lengths, fg.time) if t > 0}):
        kept = acg_checkpoints(fg.dag, search=DivisionSearch(fg.dag, root, lengths - mu * fg.time)).checkpoints
        sets.append(simulate(problem, reforward_schedule(fg, kept)))
    top = simulate(problem, default_schedule(problem)).peak_bytes
    checked = 0
    for budget in sorted({s.peak_bytes for s in sets if s.peak_bytes < top}):
        k = sum(s.peak_bytes <= budget for s in sets)
        if not all(s.peak_bytes <= budget for s in sets[:k]):
            continue                                 # fitting is not monotone in mu at this budget
        best, tried = budgeted(fg, root, budget)
        assert best.simulation.peak_bytes <= budget
        assert best.simulation.compute_cost <= sets[k - 1].compute_cost, budget
        assert len({c.checkpoints for c in tried}) == len(tried)
        checked += 1
    assert checked >= 2
