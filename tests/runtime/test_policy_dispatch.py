"""Selective checkpointing's dispatch cost (runtime/policy/dispatch_cost.py, runtime.policy.form.dispatch_cost): the
profile measures it for a graph captured for the policy form and stores it with the run; `selective-policy`
counts it for the regions it runs with a policy, so where it outweighs what a policy saves, the plan
checkpoints those regions whole (plain `torch.utils.checkpoint`) instead; plans carry it in `predicted`."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from memplan.runtime.tracing.capture import capture
from memplan.runtime.format.plan import Plan
from memplan.runtime.policy.apply import capture_eager
from memplan.runtime.policy.form import Regions, decisions, policy_schedule
from memplan.tasks.profile.stage import ProfileSettings, measure_graph, profile_graph
from memplan.tasks.solve import SOLVERS, parse_options, solve
from memplan.tasks.solve.core.problem import Problem, ProblemError
from memplan.tasks.solve.core.simulator import simulate
from memplan.tasks.solve.core.solution import SolveOptions
from memplan.tasks.store.query import load_costs
from tests.runtime.test_policy import build

SETTINGS = ProfileSettings(warmup=1, repeats=2, rounds=1)


def test_the_profile_measures_the_dispatch_of_a_policy_form_graph_and_the_store_keeps_it(tmp_path):
    """A graph captured for the policy form gets positive per-node costs for the forward and the recomputation
    modes, read back from the store into the problem; a graph captured for the executor gets none (null)."""
    model, loss_fn, batch = build("mlp")
    graph = capture_eager(model, loss_fn, batch)
    run = profile_graph(graph, settings=SETTINGS, model="mlp", root=tmp_path, progress=False)
    costs = load_costs(graph.fingerprint, root=tmp_path)
    assert costs.run_id == run.run_id and costs.policy_ms is not None
    forward, recompute = costs.policy_ms
    assert forward > 0 and recompute > 0
    assert Problem.from_graph(graph, costs).policy_dispatch == (forward, recompute)

    executor = capture(model, loss_fn, batch)
    rows = measure_graph(executor, settings=SETTINGS, model="mlp", progress=False)
    assert {(r["policy_forward_ms"], r["policy_recompute_ms"]) for r in rows} == {(None, None)}
    assert Problem.from_graph(executor).policy_dispatch == (0.0, 0.0)


def _policy_cost(problem: Problem, regions: Regions, saved: dict) -> float:
    """The dispatch cost of a decision, counted here: per region saving nodes, the forward cost per node times
    its forward nodes plus the recomputation cost per node times the nodes of its rerun range."""
    forward, recompute = problem.policy_dispatch
    total = 0.0
    for name, keep in saved.items():
        if keep:
            total += forward * len(regions.members[name]) + recompute * len(regions.rerun[name])
    return total


def _with_a_policy():
    """The tiny GPT-2's eager graph, its unprofiled problem and the least budget (from per-block's peak up, in
    steps of 5% of it) where `selective-policy` without a dispatch cost runs some layer with a policy."""
    model, loss_fn, batch = build("gpt2")
    graph = capture_eager(model, loss_fn, batch)
    problem = Problem.from_graph(graph)
    regions = Regions.of_graph(graph)
    whole = simulate(problem, policy_schedule(regions, {r: frozenset() for r in regions.members})).peak_bytes
    for budget in range(whole, whole * 3, whole // 20):
        solution = solve(problem, "selective-policy", budget)
        if any(decisions(Regions.of_graph(graph, solution.policy_split, solution.policy_nest),
                         solution.schedule).values()):
            return graph, problem, budget
    raise AssertionError("no budget where the unpriced solver runs a layer with a policy")


def test_the_solver_checkpoints_whole_where_the_dispatch_outweighs_what_a_policy_saves():
    """On the tiny GPT-2, at a budget where the solver without a dispatch cost runs some layer with a policy:
    priced at 1 per node (as dear as an op), it returns a plan running none with a policy, cheaper counted
    with that price than the unpriced plan; its objective is compute plus dispatch (0 here). Solved for
    torch.compile (`compiled = true`), which runs no dispatch mode, it is the unpriced plan. At a small price
    (1e-4) the plan keeps its policies and its objective adds their dispatch, counted here."""
    graph, free, budget = _with_a_policy()
    unpriced = solve(free, "selective-policy", budget)
    unpriced_regions = Regions.of_graph(graph, unpriced.policy_split, unpriced.policy_nest)
    unpriced_saved = decisions(unpriced_regions, unpriced.schedule)

    dear = dataclasses.replace(free, policy_dispatch=(1.0, 1.0))
    priced = solve(dear, "selective-policy", budget)
    saved = decisions(Regions.of_graph(graph, priced.policy_split, priced.policy_nest), priced.schedule)
    assert priced.feasible and not any(saved.values()) and priced.dispatch_cost == 0
    assert priced.objective == priced.simulation.compute_cost
    assert priced.objective < unpriced.simulation.compute_cost + _policy_cost(dear, unpriced_regions, unpriced_saved)

    under_compile = solve(dear, "selective-policy", budget, SolveOptions(params=parse_options(
        SOLVERS["selective-policy"], {"compiled": True})))
    assert under_compile.dispatch_cost == 0 and under_compile.objective == unpriced.objective
    assert under_compile.schedule == unpriced.schedule

    cheap = dataclasses.replace(free, policy_dispatch=(1e-4, 2e-4))
    kept = solve(cheap, "selective-policy", budget)
    kept_regions = Regions.of_graph(graph, kept.policy_split, kept.policy_nest)
    kept_saved = decisions(kept_regions, kept.schedule)
    assert any(kept_saved.values())
    assert kept.dispatch_cost == pytest.approx(_policy_cost(cheap, kept_regions, kept_saved), rel=1e-12)
    assert kept.objective == pytest.approx(kept.simulation.compute_cost + kept.dispatch_cost, rel=1e-12)


def test_a_plan_carries_its_dispatch_cost_in_its_predicted_time(tmp_path):
    """With profiled milliseconds, `predicted.time_ms` is compute plus dispatch and `predicted.dispatch_cost`
    the dispatch; the plan saves and loads with it."""
    graph, free, budget = _with_a_policy()
    problem = dataclasses.replace(free, cost_unit="ms", policy_dispatch=(1e-4, 1e-4))
    solution = solve(problem, "selective-policy", budget)
    assert solution.dispatch_cost > 0
    plan = solution.to_plan(problem)
    plan.save(tmp_path / "plan.json")
    predicted = Plan.load(tmp_path / "plan.json").predicted
    assert predicted["dispatch_cost"] == solution.dispatch_cost
    assert predicted["time_ms"] == pytest.approx(predicted["compute_cost"] + solution.dispatch_cost, rel=1e-12)


@pytest.mark.parametrize("bad", [(1.0,), (-1.0, 0.0), (float("nan"), 0.0)])
def test_a_malformed_dispatch_cost_is_refused(bad):
    model, loss_fn, batch = build("mlp")
    problem = Problem.from_graph(capture_eager(model, loss_fn, batch))
    with pytest.raises(ProblemError, match="policy_dispatch"):
        dataclasses.replace(problem, policy_dispatch=bad)


def test_the_measurement_needs_a_recorded_region():
    """A graph with no repeated module has no region to replay: no measurement, not a guess."""
    from memplan.runtime import node_function
    from memplan.runtime.policy.dispatch_cost import policy_dispatch_ms
    from memplan.tasks.profile.stage import graph_inputs

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.linear(x).relu()

    graph = capture_eager(Net(), lambda m, x: m(x).sum(), (torch.randn(2, 4),))
    cpu = torch.device("cpu")
    assert policy_dispatch_ms(graph, cpu, graph_inputs(graph, cpu, 0),
                              [node_function(graph, n.id) for n in graph.nodes]) is None
