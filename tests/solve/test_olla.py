"""OLLA: the lifetime ILP's peak equals an exhaustive search over topological orders, and the location
ILP's addresses pass the simulator's checker with an arena between the live bytes and greedy's."""

from __future__ import annotations

import dataclasses
import json
from functools import partial

import numpy as np
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from memplan.tasks.problems import LoadedProblem
from memplan.tasks.solve import solve
from memplan.tasks.solve.core.addresses import greedy_addresses
from memplan.tasks.solve.olla.lifetime import lifetime_order
from memplan.tasks.solve.olla.location import olla_addresses
from memplan.tasks.solve.olla.window import window_problem
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import simulate
from memplan.tasks.solve.core.solution import SolveOptions
from memplan.tasks.solve_stage import solve_loaded
from memplan.tasks.config import parse_budget

MAX_ORDERS = 600


@st.composite
def graphs(draw, max_nodes: int = 8) -> Problem:
    """A random training-like graph: nodes with one or two output values, reads of earlier values,
    workspaces, graph outputs (every unread value and a few more) and random nodes."""
    n = draw(st.integers(2, max_nodes))
    sizes = st.integers(0, 40)
    outputs, producer, bytes_ = [], [], []
    inputs = []
    for v in range(n):
        earlier = list(range(len(bytes_)))
        reads = draw(st.lists(st.sampled_from(earlier), max_size=3, unique=True)) if earlier else []
        inputs.append(tuple(sorted(reads)))
        k = draw(st.integers(1, 2))
        outputs.append(tuple(range(len(bytes_), len(bytes_) + k)))
        bytes_ += [draw(sizes) for _ in range(k)]
        producer += [v] * k
    read = {x for r in inputs for x in r}
    extra = draw(st.lists(st.sampled_from(range(len(bytes_))), max_size=2, unique=True))
    graph_outputs = tuple(sorted({x for x in range(len(bytes_)) if x not in read} | set(extra)))
    random_nodes = tuple(draw(st.lists(st.sampled_from(range(n)), max_size=3, unique=True)))
    return Problem(
        name="hyp", cost=np.ones(n), workspace=np.array([draw(st.integers(0, 10)) for _ in range(n)]),
        phase=("forward",) * n, node_inputs=tuple(inputs), node_outputs=tuple(outputs),
        value_bytes=np.array(bytes_, dtype=np.int64), value_producer=np.array(producer, dtype=np.int64),
        outputs=graph_outputs, order=np.arange(n), random_nodes=random_nodes)


def topological_orders(problem: Problem) -> list[list[int]]:
    """Every order running each node after the producers of its inputs and the random nodes in their
    default relative order (written here independently of the solver's spans and control edges)."""
    n = problem.num_nodes
    preds = [{int(problem.value_producer[x]) for x in problem.node_inputs[v]} for v in range(n)]
    rand = sorted(problem.random_nodes)
    for a, b in zip(rand, rand[1:]):
        preds[b].add(a)
    found: list[list[int]] = []

    def extend(order: list[int], done: set[int]) -> None:
        if len(found) > MAX_ORDERS:
            return
        if len(order) == n:
            found.append(list(order))
        for v in range(n):
            if v not in done and preds[v] <= done:
                order.append(v)
                done.add(v)
                extend(order, done)
                order.pop()
                done.discard(v)

    extend([], set())
    return found


def peak(problem: Problem, order: list[int]) -> int:
    return simulate(problem, [("compute", v) for v in order]).peak_bytes


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(graphs())
def test_lifetime_ilp_peak_equals_exhaustive_search(problem):
    orders = topological_orders(problem)
    assume(len(orders) <= MAX_ORDERS)
    best = min(peak(problem, order) for order in orders)
    found = lifetime_order(problem, gap=0.0, warm_start=False)       # the ILP alone, from no start
    assert found.status == "optimal" and found.source == "ilp"
    assert found.order in orders
    assert found.peak_bytes == best
    assert abs(found.bound_bytes - best) <= 1e-6 * max(best, 1)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graphs(max_nodes=10), st.data())
def test_olla_addresses_pass_the_checker_between_live_bytes_and_greedy(problem, data):
    schedule = [("compute", v) for v in range(problem.num_nodes)]
    schedule += [("compute", data.draw(st.integers(0, problem.num_nodes - 1))) for _ in range(data.draw(st.integers(0, 2)))]
    sim = simulate(problem, schedule)
    steps = np.array(data.draw(st.lists(st.booleans(), min_size=len(schedule), max_size=len(schedule))))
    placed = olla_addresses(problem, sim, steps, gap=0.0)
    checked = simulate(problem, schedule, placed.addresses)              # raises AddressConflict on overlap
    greedy = simulate(problem, schedule, greedy_addresses(problem, sim, steps))
    live = max((sum(int(sim.copy_bytes[c]) for c in range(len(sim.copy_value))
                    if (sim.copy_start[c], sim.copy_value[c]) in placed.addresses
                    and sim.copy_start[c] <= t <= sim.copy_end[c]) for t in range(len(schedule))), default=0)
    assert set(placed.addresses) == set(greedy_addresses(problem, sim, steps))
    assert checked.arena_bytes == placed.arena_bytes
    assert live == placed.live_bytes <= placed.arena_bytes <= greedy.arena_bytes


def test_location_ilp_beats_greedy_down_to_the_live_bytes():
    """Five values of 192, 320, 192, 192, 128 bytes: greedy (largest first) leaves a hole the ILP avoids."""
    problem = Problem.from_edges([1.0] * 5, [192, 320, 192, 192, 128], [(0, 3), (2, 3)])
    schedule = [("compute", v) for v in range(5)]
    sim = simulate(problem, schedule)
    live = int(sim.timeline.max())
    greedy = simulate(problem, schedule, greedy_addresses(problem, sim)).arena_bytes
    placed = olla_addresses(problem, sim, gap=0.0, use_pyramid=False)
    assert placed.source == "ilp" and placed.status == "optimal"
    assert simulate(problem, schedule, placed.addresses).arena_bytes == placed.arena_bytes == live < greedy


def test_olla_solver_runs_every_node_once_keeping_random_nodes_in_order():
    """Chains a0 -> a1 and b0 -> b1 (100-byte values, then 1-byte ones) joined by f. Unconstrained, chain
    a finishes before b starts (peak 102); random nodes a0, b0, a1 drawn in that order force both
    100-byte values to coexist (peak 201, the default order's)."""
    problem = Problem(
        name="chains", cost=np.ones(5), workspace=np.zeros(5, dtype=np.int64), phase=("forward",) * 5,
        node_inputs=((), (0,), (), (2,), (1, 3)), node_outputs=((0,), (1,), (2,), (3,), (4,)),
        value_bytes=np.array([100, 1, 100, 1, 1]), value_producer=np.arange(5), outputs=(4,),
        order=np.array([0, 2, 1, 3, 4]), random_nodes=(0, 1, 2))
    default = simulate(problem, [("compute", int(v)) for v in problem.order]).peak_bytes
    solution = solve(problem, "olla", default, SolveOptions(gap=0.0))
    order = [step[1] for step in solution.schedule]
    assert sorted(order) == list(range(5)) and solution.status == "optimal"
    assert order.index(0) < order.index(2) < order.index(1)
    free = dataclasses.replace(problem, random_nodes=())
    unconstrained = solve(free, "olla", default, SolveOptions(gap=0.0))
    assert unconstrained.predicted_peak_bytes == 102 < solution.predicted_peak_bytes == default == 201


def test_without_the_ilp_the_order_is_the_better_of_the_default_and_the_greedy_memory_order():
    """The chains above: the greedy memory order finishes chain a first (peak 102, the exhaustive optimum)
    where the default order holds both 100-byte values (201); it is taken only when it keeps the random
    nodes' order."""
    problem = Problem(
        name="chains", cost=np.ones(5), workspace=np.zeros(5, dtype=np.int64), phase=("forward",) * 5,
        node_inputs=((), (0,), (), (2,), (1, 3)), node_outputs=((0,), (1,), (2,), (3,), (4,)),
        value_bytes=np.array([100, 1, 100, 1, 1]), value_producer=np.arange(5), outputs=(4,),
        order=np.array([0, 2, 1, 3, 4]))
    found = lifetime_order(problem, window=0, whole_graph=False)
    assert found.peak_bytes == peak(problem, found.order) == 102 == min(map(partial(peak, problem),
                                                                          topological_orders(problem)))
    assert found.source == "memory order"
    drawn = lifetime_order(dataclasses.replace(problem, random_nodes=(0, 1, 2)), window=0, whole_graph=False)
    assert drawn.order == [0, 2, 1, 3, 4] and drawn.peak_bytes == 201 and drawn.source == "default"


def test_window_subproblem_has_the_live_bytes_of_its_steps():
    problem = Problem.from_edges([1.0] * 6, [5, 7, 11, 13, 17, 19], [(0, 2), (1, 2), (1, 4), (2, 3), (3, 5), (4, 5)])
    order = list(range(6))
    sub, real = window_problem(problem, order, 2, 5)
    assert real == [-1, 2, 3, 4]
    full = simulate(problem, [("compute", v) for v in order]).timeline
    part = simulate(sub, [("compute", k) for k in range(4)]).timeline
    assert list(part[1:]) == list(full[2:5])          # no value lives across steps 2..4 unread there


def test_solve_stage_places_olla_addresses_on_any_schedule():
    problem = Problem.from_edges([1.0] * 5, [192, 320, 192, 192, 128], [(0, 3), (2, 3)])
    loaded = LoadedProblem(problem, None, None)
    for solver in ("checkpoint-all", "olla"):
        solution, _ = solve_loaded(loaded, solver, parse_budget(1.0), SolveOptions(gap=0.0), "olla")
        greedy = simulate(problem, solution.schedule, greedy_addresses(problem, solution.simulation))
        assert solution.addresses and solution.simulation.arena_bytes <= greedy.arena_bytes
        assert solution.to_plan(problem).predicted["arena_bytes"] == solution.simulation.arena_bytes


def test_memplan_solve_olla_with_olla_addresses(tmp_path):
    from typer.testing import CliRunner

    from memplan.flows.cli import app
    from memplan.runtime.format.plan import Plan

    sizes, links = [192, 320, 192, 192, 128], [(0, 3), (2, 3), (3, 4), (1, 4)]
    graph = tmp_path / "tiny.json"
    graph.write_text(json.dumps({
        "nodes": [{"id": i, "cost_cpu": 1.0, "cost_ram": b, "backward": False, "name": f"n{i}"} for i, b in enumerate(sizes)],
        "links": [{"source": s, "target": t} for s, t in links]}))
    out = tmp_path / "plan.json"
    args = ["solve", "--graph", str(graph), "--solver", "olla", "--budget", "100%", "--addresses", "olla",
            "--json", "--out", str(out), "--no-progress"]
    report = json.loads(CliRunner().invoke(app, args).stdout)
    plan = Plan.load(out)
    problem = Problem.from_node_link(graph)
    sim = simulate(problem, plan.schedule, plan.addresses)      # checked: no live copies overlap
    assert report["solver"] == "olla" and plan.addresses
    assert report["arena_bytes"] == plan.predicted["arena_bytes"] == sim.arena_bytes
    # default order 0..4 holds 0, 1, 2 and 3 at step 3 (896 B); running 0, 2, 3 before 1 peaks at the
    # last step: 3, 1 and 4 (640 B), which every order reaches
    assert report["predicted_peak_bytes"] == 640 < report["checkpoint_all_peak_bytes"] == 896
