"""Checkmate's MILP (tasks/solve/core/remat_milp.py) on small random graphs, without a MILP solver: the
assignment of any frontier-advancing schedule satisfies every row of the model exactly at the
schedule's simulated peak (and breaks one at the peak minus one byte), its objective is the simulated
cost, and the retention limit holds exactly when the bytes retained into its stage fit. The graphs have
multi-output nodes, graph inputs, values nothing reads, several graph outputs, workspace and a default
order that is not the node ids, so that every index family of the layout is exercised."""

from __future__ import annotations

import random

import numpy as np
import pytest

from memplan.tasks.solve.core.remat_milp import assignment_from_schedule, build_model, expand_ranges, schedule_from_solution
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import simulate


def random_problem(rng: random.Random) -> Problem:
    """3-7 nodes in a shuffled id order; node order[i] reads a random subset of earlier values (and
    sometimes the graph input, value 0) and allocates one or two values."""
    n = rng.randint(3, 7)
    ids = list(range(n))
    rng.shuffle(ids)                                   # order[i] = ids[i]: node ids are not positions
    outputs_of: dict[int, tuple[int, ...]] = {}
    producer = [-1]
    node_inputs: dict[int, tuple[int, ...]] = {}
    for node in ids:
        earlier = list(range(1, len(producer)))
        reads = {v for v in earlier if rng.random() < 0.45} | ({0} if rng.random() < 0.3 else set())
        if earlier and not reads - {0}:
            reads.add(earlier[-1])
        node_inputs[node] = tuple(sorted(reads))
        count = 2 if rng.random() < 0.35 else 1
        outputs_of[node] = tuple(range(len(producer), len(producer) + count))
        producer += [node] * count
    nv = len(producer)
    read = {v for ins in node_inputs.values() for v in ins}
    unread = [v for v in range(1, nv) if v not in read]
    outputs = tuple(sorted({outputs_of[ids[-1]][0]} | {v for v in unread if rng.random() < 0.5}))
    return Problem(name="random", cost=np.array([rng.choice([1.0, 2.0, 3.5]) for _ in range(n)]),
                   workspace=np.array([rng.choice([0, 0, 1, 2, 7]) for _ in range(n)], dtype=np.int64),
                   phase=("forward",) * n, node_inputs=tuple(node_inputs[i] for i in range(n)),
                   node_outputs=tuple(outputs_of[i] for i in range(n)),
                   value_bytes=np.array([rng.randint(1, 9) for _ in range(nv)], dtype=np.int64),
                   value_producer=np.array(producer, dtype=np.int64), outputs=outputs,
                   order=np.array(ids, dtype=np.int64))


def random_schedule(problem: Problem, rng: random.Random) -> list[tuple[str, int]]:
    """Stage t recomputes a random subset of the nodes before position t (in order), then order[t]. Only
    recomputations the model can express: of nodes allocating no graph output (the model retains graph
    outputs from their first computation on, S = 1), each read later in its stage (the model frees a
    value after a user runs, so a copy nothing reads would be held to the end of the stage)."""
    order = problem.order.tolist()
    again = {k for k in order if not problem.is_output[list(problem.node_outputs[k])].any()}
    steps = []
    for t, node in enumerate(order):
        stage = [node]
        for k in reversed([k for k in order[:t] if k in again and rng.random() < 0.4]):
            if any(set(problem.node_outputs[k]) & set(problem.node_inputs[j]) for j in stage):
                stage.insert(0, k)
        steps += [("compute", k) for k in stage]
    return steps


def violated(model, x) -> bool:
    Ax = model.A @ x
    tol = 1e-9 * (abs(model.A) @ np.abs(x)) + 1e-9
    rows = np.any(Ax < model.row_lower - tol) or np.any(Ax > model.row_upper + tol)
    cols = np.any(x < model.col_lower - 1e-9) or np.any(x > model.col_upper + 1e-9)
    return bool(rows or cols)


CASES = [(seed, formulation) for seed in range(40) for formulation in ("tight", "paper")]


@pytest.mark.parametrize("seed, formulation", CASES)
def test_a_schedule_satisfies_the_model_exactly_at_its_simulated_peak(seed, formulation):
    rng = random.Random(seed)
    problem = random_problem(rng)
    schedule = random_schedule(problem, rng)
    sim = simulate(problem, schedule)
    model, L = build_model(problem, sim.peak_bytes, formulation)
    x = assignment_from_schedule(problem, L, schedule)
    assert not violated(model, x)
    assert model.c @ x * model.objective_scale == pytest.approx(sim.compute_cost, rel=1e-12)
    binary = x[model.integrality]
    assert np.all((binary == 0) | (binary == 1))
    assert schedule_from_solution(L, x) == schedule
    # U[t,k] + W_k R[t,k] is the simulator's memory while the step runs, so one byte less breaks a row
    tight, L2 = build_model(problem, sim.peak_bytes - 1, formulation)
    assert violated(tight, assignment_from_schedule(problem, L2, schedule))


@pytest.mark.parametrize("seed", range(12))
def test_the_retention_limit_holds_exactly_when_the_retained_bytes_fit(seed):
    rng = random.Random(100 + seed)
    problem = random_problem(rng)
    schedule = random_schedule(problem, rng)
    peak = simulate(problem, schedule).peak_bytes
    n = problem.num_nodes
    _, L = build_model(problem, peak)
    x = assignment_from_schedule(problem, L, schedule)
    for stage in range(n):                          # nothing is retained into stage 0 (eq. 8b)
        held = sum(L.mb[iv] * x[L.s(stage, iv)] for iv in range(len(L.vals)) if L.pp[iv] < stage)
        fits, _ = build_model(problem, peak, retained=(stage, held))
        assert not violated(fits, x), stage
        if held > 0:
            over, _ = build_model(problem, peak, retained=(stage, held - 1))
            assert violated(over, x), stage


def test_schedules_that_do_not_advance_the_frontier_have_no_assignment():
    problem = Problem.from_edges([1.0] * 3, [1] * 3, [(0, 1), (1, 2)])
    _, L = build_model(problem, 10)
    assert assignment_from_schedule(problem, L, [("compute", 0), ("compute", 1), ("compute", 2)]) is not None
    assert assignment_from_schedule(problem, L, [("compute", 1), ("compute", 0), ("compute", 2)]) is None
    assert assignment_from_schedule(problem, L, [("compute", 0), ("compute", 1)]) is None
    # a stage out of order, a node twice in one stage, past the last stage
    for steps in ([0, 1, 1, 0, 2], [0, 1, 1, 1, 2], [0, 1, 2, 0]):
        assert assignment_from_schedule(problem, L, [("compute", k) for k in steps]) is None


def test_free_steps_do_not_change_the_assignment():
    """Frees are left to the simulator (each value is released after its last use), so a schedule with
    explicit frees has the assignment of the same schedule without them."""
    problem = Problem.from_edges([1.0] * 4, [1] * 4, [(0, 1), (1, 2), (2, 3), (0, 3)])
    _, L = build_model(problem, 10)
    plain = [("compute", k) for k in (0, 1, 2, 3)]
    freed = [("compute", 0), ("compute", 1), ("free", 0), ("compute", 0), ("compute", 2), ("free", 1),
             ("compute", 3)]
    kept = [("compute", k) for k in (0, 1, 0, 2, 3)]
    assert np.array_equal(assignment_from_schedule(problem, L, freed), assignment_from_schedule(problem, L, kept))
    assert not np.array_equal(assignment_from_schedule(problem, L, kept), assignment_from_schedule(problem, L, plain))


def test_unknown_formulation_is_refused():
    problem = Problem.from_edges([1.0] * 2, [1] * 2, [(0, 1)])
    with pytest.raises(ValueError, match="formulation 'loose' is unknown; choose one of paper, tight"):
        build_model(problem, 10, "loose")


def test_expand_ranges_lists_every_member_of_each_range():
    item, value = expand_ranges(np.array([2, 5, 0, 3]), np.array([4, 5, 1, 6]))
    assert item.tolist() == [0, 0, 2, 3, 3, 3] and value.tolist() == [2, 3, 0, 3, 4, 5]


@pytest.mark.parametrize("seed", range(6))
def test_the_budget_rows_and_columns_scale_the_budget(seed):
    """`checkmate-approx` re-solves the LP relaxation under (1 - eps) of the budget by scaling the bounds
    the model lists as budget rows (workspace) and columns (U): each LP of the sweep is the LP of the model
    built for that budget."""
    from memplan.tasks.solve.core.milp import MilpOptions, solve_lp_sweep, solve_milp

    rng = random.Random(200 + seed)
    problem = random_problem(rng)
    budget = simulate(problem, random_schedule(problem, rng)).peak_bytes
    model, L = build_model(problem, budget)
    scales = [1.0, 0.9, 0.75, 0.5, 0.3]
    for scale, lp in zip(scales, solve_lp_sweep(model, scales, MilpOptions(backend="highs"))):
        direct = solve_milp(build_model(problem, scale * budget)[0], MilpOptions(backend="highs", relax=True))
        assert lp.status == direct.status, scale
        if direct.status == "optimal":
            assert lp.objective == pytest.approx(direct.objective, rel=1e-7), scale
            assert lp.x[L.u_base:].max() <= scale + 1e-7                 # memory within the scaled budget


def test_a_graph_that_costs_nothing_has_a_finite_objective():
    problem = Problem.from_edges([0.0] * 3, [1] * 3, [(0, 1), (1, 2)])
    model, L = build_model(problem, 10)
    x = assignment_from_schedule(problem, L, [("compute", k) for k in (0, 1, 2)])
    assert np.isfinite(model.c).all() and model.c @ x * model.objective_scale == 0.0
