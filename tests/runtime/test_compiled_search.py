"""`tasks.compiled.policy_search`: the cheapest policy-form plan whose measured peak fits the budget, where the measured
peak is not the predicted one (torch.compile's partitioner keeps less, or more, than eager autograd).

With a measurement that is an exact function of the predicted peak, the answer is computed independently: the
plan `selective-policy` returns at the largest solve budget whose plans measure within the budget. Then the
search with torch.compile measuring, on conftest's tiny GPT-2 with dropout."""

from __future__ import annotations

import copy

import pytest
import torch

from memplan.runtime.policy.compiled_peak import compiled_peak
from memplan.runtime.format.plan import graph_provenance
from memplan.runtime.policy.apply import capture_eager
from memplan.runtime.policy.form import Regions, policy_schedule
from memplan.tasks.compiled import policy_search as compiled_search
from memplan.tasks.compiled.policy_search import COMPILED, search
from memplan.tasks.solve import solve
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import simulate

from .test_policy import build


@pytest.fixture(scope="module")
def gpt2():
    model, loss_fn, batch = build("gpt2")
    graph = capture_eager(model, loss_fn, batch)
    problem = Problem.from_graph(graph)
    regions = Regions.of_graph(graph)
    whole = simulate(problem, policy_schedule(regions, {r: frozenset() for r in regions.members})).peak_bytes
    return model, loss_fn, batch, graph, problem, whole


@pytest.mark.parametrize("num, den, extra, slack", [(4, 5, 0, 0), (11, 10, 0, 0), (1, 1, 1001, 1000)],
                         ids=["compiled-keeps-less", "compiled-keeps-more", "a-byte-over"])
def test_the_search_returns_the_cheapest_plan_that_measures_within(gpt2, monkeypatch, num, den, extra, slack):
    """Measured peak = predicted * num // den + extra, the budget `slack` above a plan's predicted peak. In
    "a-byte-over" the first plan measures one byte over the budget, 1000 bytes above the plan: the search must
    step below the plan, not crawl down to it a few bytes at a time."""
    *_, problem, whole = gpt2
    budget = solve(problem, "selective-policy", whole * 11 // 10, COMPILED).predicted_peak_bytes + slack
    calls, solves = [], []
    monkeypatch.setattr(compiled_search, "solve", lambda *args: solves.append(args) or solve(*args))

    def measure(solution):
        calls.append(solution)
        return solution.predicted_peak_bytes * num // den + extra

    result = search(problem, budget, measure, probes=100, tolerance=0)
    largest = (den * (budget - extra) + den - 1) // num  # the largest solve budget b with b * num // den + extra <= budget
    assert largest * num // den + extra <= budget < (largest + 1) * num // den + extra
    expected = solve(problem, "selective-policy", largest, COMPILED)
    assert result.best is not None and result.best.measured_peak <= budget
    assert result.best.solution.objective == expected.objective
    assert expected.predicted_peak_bytes * num // den + extra <= budget
    schedules = [str(s.schedule) + str(s.policy_split) + str(s.policy_nest) for s in calls]
    assert len(set(schedules)) == len(schedules) == len(result.probes)      # no plan measured twice
    assert len(solves) <= 64, len(solves)                                    # bisection, not a crawl


def test_a_floor_of_measured_peaks_at_the_budget(gpt2, monkeypatch):
    """Every plan up to a threshold T above the budget measures exactly the budget (a compiled peak's floor, as
    on the Llama of bench/policy_form.py), those above it over: the answer is the cheapest plan up to T, found
    in a few solves, not by raising the solve budget a byte at a time."""
    *_, problem, whole = gpt2
    budget = solve(problem, "selective-policy", whole, COMPILED).predicted_peak_bytes
    threshold = solve(problem, "selective-policy", whole * 13 // 10, COMPILED).predicted_peak_bytes
    assert threshold > budget
    solves = []
    monkeypatch.setattr(compiled_search, "solve", lambda *args: solves.append(args) or solve(*args))
    measure = lambda s: budget if s.predicted_peak_bytes <= threshold else budget + 1  # noqa: E731
    result = search(problem, budget, measure, probes=100, tolerance=0)
    assert result.best.solution.objective == solve(problem, "selective-policy", threshold, COMPILED).objective
    assert len(solves) <= 64, len(solves)


def test_the_spread_finds_a_cheaper_plan_above_plans_that_measure_over(gpt2):
    """Compiled peaks that do not grow with the solve budget (bench/policy_form.py's GPT-2): plans predicted within
    the budget measure within, those up to a quarter above it over, those from a quarter to a half above within
    again, higher ones over. The bisection alone ends at the first kind; the spread probes find the third, which
    is cheaper, measuring `spread` plans more at most."""
    *_, problem, whole = gpt2
    budget = solve(problem, "selective-policy", whole, COMPILED).predicted_peak_bytes

    def measure(solution):
        ratio = solution.predicted_peak_bytes / budget
        return budget if ratio <= 1 or 1.25 < ratio <= 1.5 else budget + 1

    alone = search(problem, budget, measure, probes=100, tolerance=0)
    spread = search(problem, budget, measure, probes=100, spread=6, tolerance=0)
    assert alone.best.solution.predicted_peak_bytes <= budget
    assert 1.25 * budget < spread.best.solution.predicted_peak_bytes <= 1.5 * budget
    assert spread.best.solution.objective < alone.best.solution.objective
    assert spread.best.measured_peak <= budget
    first = [(p.solve_budget, p.measured_peak) for p in spread.probes[:len(alone.probes)]]
    assert first == [(p.solve_budget, p.measured_peak) for p in alone.probes]     # then the spread
    assert len(alone.probes) < len(spread.probes) <= len(alone.probes) + 6


def test_the_search_stops_at_its_probes_and_refuses_bad_input(gpt2):
    *_, problem, whole = gpt2
    result = search(problem, whole, lambda s: s.predicted_peak_bytes // 2, probes=2)
    assert len(result.probes) == 2
    assert [p.solve_budget for p in result.probes] == sorted(p.solve_budget for p in result.probes)
    assert result.best is result.probes[-1]                      # each measured within: it solved higher
    with pytest.raises(ValueError, match="positive budget"):
        search(problem, 0, lambda s: 0)
    with pytest.raises(ValueError, match="probe"):
        search(problem, whole, lambda s: 0, probes=0)
    with pytest.raises(ValueError, match="spread"):
        search(problem, whole, lambda s: 0, spread=-1)


def test_the_search_under_torch_compile(gpt2):
    """Budget: the compiled peak of every layer checkpointed whole (here a third above its prediction, so the
    plans solved at it measure over it): the search finds a plan within, whichever way compiling moves peaks."""
    model, loss_fn, batch, graph, problem, whole = gpt2
    before = copy.deepcopy(model.state_dict())
    generator = torch.get_rng_state()

    def measure(solution):
        plan = solution.to_plan(problem)
        plan.provenance.update(graph_provenance(graph))
        return compiled_peak(plan, model, loss_fn, batch, graph=graph, backend="aot_eager_decomp_partition")

    budget = measure(solve(problem, "selective-policy", whole, COMPILED))
    result = search(problem, budget, measure, probes=3)
    assert torch.equal(torch.get_rng_state(), generator)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    best = result.best
    assert best is not None and best.measured_peak <= budget
    assert measure(best.solution) == best.measured_peak                  # the measurement repeats


def test_a_plan_updating_inside_the_step_is_measured_with_its_optimizer(gpt2):
    """With `optimizer=`, the copy under the plan updates its parameters inside the compiled step (the optimizer
    is made over the copy): the model measured is left as it was."""
    model, loss_fn, batch, graph, problem, whole = gpt2
    before = copy.deepcopy(model.state_dict())
    plan = solve(problem, "selective-policy", whole, COMPILED).to_plan(problem)
    plan.provenance.update(graph_provenance(graph))
    made = []

    def adamw(replica):
        made.append(torch.optim.AdamW(replica.parameters(), lr=0.01))
        return made[-1]

    assert compiled_peak(plan, model, loss_fn, batch, graph=graph, backend="aot_eager", optimizer=adamw) > 0
    assert all(made[0].state[p]["step"] == 2 for p in made[0].param_groups[0]["params"])    # two steps, each updated
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
