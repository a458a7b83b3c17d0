"""A plan's arena addresses are checked structurally before any step runs: `Plan.validate` refuses exactly
the address sets the simulator's own check (`tasks.solve.core.simulator.check_addresses`) refuses, and
misaligned or corrupt offsets, so `runtime.load(..., arena=True)` never runs an overlapping plan."""

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memplan import runtime
from memplan.runtime.format.plan import Plan, PlanError
from memplan.tasks.solve.core.addresses import greedy_addresses
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import AddressConflict, check_addresses, simulate


@pytest.fixture(scope="module", params=["mlp", "resnet18"])
def planned(request, captured, helpers):
    """(model, loss_fn, batch, graph, problem, schedule, simulation, greedy addresses) for a recomputing plan."""
    model, loss_fn, batch, graph = captured(request.param)
    schedule = helpers.recompute_schedule(graph, helpers.chen_sqrt_n_drop(graph))
    problem = Problem.from_graph(graph)
    sim = simulate(problem, schedule)
    return model, loss_fn, batch, graph, problem, schedule, sim, greedy_addresses(problem, sim)


def _simulator_refuses(problem, sim, addresses) -> bool:
    try:
        check_addresses(problem, sim, addresses)
    except AddressConflict:
        return True
    return False


def test_greedy_addresses_pass_and_all_overlapping_addresses_are_refused(planned):
    *_, graph, problem, schedule, sim, addresses = planned
    Plan(graph.fingerprint, schedule, addresses).validate(graph)
    overlapping = dict.fromkeys(addresses, 0)
    assert _simulator_refuses(problem, sim, overlapping)
    with pytest.raises(PlanError, match="overlap"):
        Plan(graph.fingerprint, schedule, overlapping).validate(graph)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_moved_addresses_are_refused_exactly_when_the_simulator_refuses_them(planned, data):
    *_, graph, problem, schedule, sim, addresses = planned
    copies = sorted(addresses)
    moved = dict(addresses)
    for copy_ in data.draw(st.lists(st.sampled_from(copies), min_size=1, max_size=4, unique=True)):
        target = data.draw(st.sampled_from(copies))
        moved[copy_] = addresses[target] + 16 * data.draw(st.integers(-2, 2))
    moved = {c: max(0, o) for c, o in moved.items()}
    refused = _simulator_refuses(problem, sim, moved)
    plan = Plan(graph.fingerprint, schedule, moved)
    if refused:
        with pytest.raises(PlanError, match="overlap"):
            plan.validate(graph)
    else:
        plan.validate(graph)


def test_misaligned_and_corrupt_offsets_are_refused(planned):
    *_, graph, problem, schedule, sim, addresses = planned
    float_copy = next(c for c in sorted(addresses) if graph.values[c[1]].dtype == "float32"
                      and graph.values[c[1]].bytes > 0)
    with pytest.raises(PlanError, match="element size 4"):
        Plan(graph.fingerprint, schedule, {**addresses, float_copy: addresses[float_copy] + 2}).validate(graph)
    with pytest.raises(PlanError, match="corrupt"):
        Plan(graph.fingerprint, schedule, {**addresses, float_copy: 2**63 - 8}).validate(graph)


def test_an_overlapping_plan_is_refused_before_any_step_runs(planned):
    model, loss_fn, batch, graph, problem, schedule, sim, addresses = planned
    model = copy.deepcopy(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    step = runtime.load(Plan(graph.fingerprint, schedule, dict.fromkeys(addresses, 0)), model, loss_fn,
                        graph=graph, arena=True)
    with pytest.raises(PlanError, match="overlap"):
        step(*batch)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
