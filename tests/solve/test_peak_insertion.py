"""Peak-directed recomputation insertion (tasks/solve/core/peak_insertion.py): its vectorized simulation equals the
shared simulator, its schedules fit and are never cheaper than an exhaustive optimum over all schedules, a
hand-checked chain gets its optimum, and moccasin takes its frontier-advancing form as a hint."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.tasks.solve.moccasin import add_hint, build_model, frontier_slots, insertion_start
from memplan.tasks.solve.core.peak_insertion import _Schedules, peak_insertion_schedule
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import default_schedule, simulate
from memplan.tasks.solve.core.solution import min_budget_lower_bound

from tests.solve.test_dtr import cheapest_schedule_cost, small_dags


def random_recomputations(problem: Problem, seed: int) -> list[int]:
    """The default order with, before random steps, recomputations of random earlier nodes (a valid
    compute-only schedule: a value once computed stays readable)."""
    rng = np.random.default_rng(seed)
    steps: list[int] = []
    for node in problem.order.tolist():
        if steps and rng.random() < 0.5:
            steps.append(int(rng.choice(steps)))
        steps.append(node)
    return steps


@settings(max_examples=40, deadline=None)
@given(small_dags(), st.integers(0, 10 ** 6))
def test_vectorized_simulation_equals_the_simulator(problem, seed):
    steps = random_recomputations(problem, seed)
    live = _Schedules(problem).simulate(np.asarray(steps))[0]
    assert np.array_equal(live, simulate(problem, [("compute", v) for v in steps]).timeline)


def test_vectorized_simulation_on_an_operator_graph():
    """Graph inputs, backward nodes, two graph outputs (tests/solve/test_monet.masked_chain, no variants)."""
    from tests.solve.test_monet import masked_chain

    problem = masked_chain(4, n=5).without_variants()
    for seed in range(5):
        steps = random_recomputations(problem, seed)
        live = _Schedules(problem).simulate(np.asarray(steps))[0]
        assert np.array_equal(live, simulate(problem, [("compute", v) for v in steps]).timeline)
    assert _Schedules(problem).simulate(np.asarray(problem.order[::-1])) is None     # reads before computing


@settings(max_examples=25, deadline=None)
@given(small_dags(), st.floats(0.0, 1.0))
def test_fits_and_never_below_the_exhaustive_optimum(problem, fraction):
    eager = simulate(problem, default_schedule(problem)).peak_bytes
    lower = min_budget_lower_bound(problem)
    budget = int(lower + fraction * (eager - lower))
    schedule = peak_insertion_schedule(problem, budget)
    if schedule is None:
        return
    sim = simulate(problem, schedule)
    assert sim.peak_bytes <= budget
    assert sim.compute_cost >= cheapest_schedule_cost(problem, budget) - 1e-9
    assert list(dict.fromkeys(node for _, node in schedule)) == problem.order.tolist()   # first computations


def test_no_recomputation_at_the_eager_peak():
    problem = Problem.from_edges([1, 2, 4, 8], [1, 2, 2, 1], [(0, 1), (1, 2), (2, 3), (0, 3)])
    assert peak_insertion_schedule(problem, 5) == default_schedule(problem)


def test_chain_gets_its_optimum():
    """a -> b -> c -> d, d also reads a; bytes 1, 2, 2, 1, costs 1, 2, 4, 8 (tests/solve/test_dtr.py):
    at budget 4, a is dropped after b and computed again just before d: 15 + 1."""
    problem = Problem.from_edges([1, 2, 4, 8], [1, 2, 2, 1], [(0, 1), (1, 2), (2, 3), (0, 3)])
    schedule = peak_insertion_schedule(problem, 4)
    assert schedule == [("compute", n) for n in (0, 1, 2, 0, 3)]
    assert simulate(problem, schedule).peak_bytes == 4 and cheapest_schedule_cost(problem, 4) == 16


def test_budget_below_every_schedule_gives_none():
    problem = Problem.from_edges([1, 1, 1], [3, 5, 2], [(0, 1), (1, 2)])
    assert peak_insertion_schedule(problem, 7) is None


@settings(max_examples=20, deadline=None)
@given(small_dags(), st.floats(0.0, 1.0), st.integers(1, 3), st.integers(0, 2))
def test_improved_schedules_fit_and_the_moccasin_start_is_a_valid_hint(problem, fraction, copies, passes):
    eager = simulate(problem, default_schedule(problem)).peak_bytes
    lower = min_budget_lower_bound(problem)
    budget = int(lower + fraction * (eager - lower))
    plain = peak_insertion_schedule(problem, budget, max_copies=copies)
    improved = peak_insertion_schedule(problem, budget, max_copies=copies, improve_passes=passes)
    if plain is not None:
        assert simulate(problem, improved).compute_cost <= simulate(problem, plain).compute_cost
    for schedule in (plain, improved):
        if schedule is not None:
            assert simulate(problem, schedule).peak_bytes <= budget
            assert max(np.bincount([v for _, v in schedule])) <= copies
    start = insertion_start(problem, budget, copies, None)
    if start is not None:
        assert simulate(problem, start).peak_bytes <= budget and frontier_slots(problem, start) is not None
        assert add_hint(problem, build_model(problem, budget, copies), start)
