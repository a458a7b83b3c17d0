"""OLLA plans run through the runtime: the reordered step equals eager PyTorch (random nodes keep their
draws), at the simulated peak, and in arena mode with OLLA's addresses."""

import copy
import warnings

import numpy as np
import pytest
import torch

from memplan import runtime
from memplan.runtime.execute.arena import ArenaFallbackWarning, in_place_nodes
from memplan.runtime.measure.exact import exact_fp32
from memplan.runtime.format.plan import Plan
from memplan.tasks.solve import solve
from memplan.tasks.solve.olla import olla_addresses
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import default_schedule, simulate
from memplan.tasks.solve.core.solution import SolveOptions

TIME_LIMIT = 4.0
ORDER = SolveOptions(time_limit=None, params={"whole_graph": False})
"""The window search to convergence (each window's ILP solved exactly), machine load notwithstanding."""


def train_arena(helpers, model, loss_fn, batch, plan, graph):
    """Loss and gradients of one step in arena mode on a copy of `model` (seeded and with ATen's own fp32
    kernels, as helpers.train_eager)."""
    model = copy.deepcopy(model)
    step = runtime.load(plan, model, loss_fn, graph=graph, arena=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ArenaFallbackWarning)     # ops without an in-place out= overload
        step.compile(*batch)
    torch.manual_seed(1)
    with exact_fp32(str(helpers.device)):
        loss = step(*batch)
    (report,) = step.arena_report.values()
    return loss.detach(), {k: p.grad for k, p in model.named_parameters()}, report


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2", "gpt2"])
def test_olla_order_and_addresses_train_like_eager(captured, helpers, name):
    model, loss_fn, batch, graph = captured(name)
    problem = Problem.from_graph(graph)
    default = simulate(problem, default_schedule(problem)).peak_bytes
    solution = solve(problem, "olla", default, ORDER)
    order = [node for _, node in solution.schedule]
    assert sorted(order) == list(range(len(graph.nodes))) and solution.predicted_peak_bytes <= default
    random = sorted(graph.program.random_devices)
    assert [order.index(v) for v in random] == sorted(order.index(v) for v in random)
    if name == "gpt2":                                   # dropout everywhere, and still a better order
        assert random and solution.predicted_peak_bytes < default and order != sorted(order)

    eager = helpers.train_eager(model, loss_fn, batch)
    plan = solution.to_plan(problem)
    result = helpers.train_plan(model, loss_fn, batch, plan, graph=graph)
    helpers.assert_same_step(eager, result, rtol=0, atol=0)
    helpers.assert_peak_matches(result.peak, solution.predicted_peak_bytes)

    nodes = in_place_nodes(graph, str(helpers.device))
    steps = np.array([node in nodes for node in order])
    placed = olla_addresses(problem, solution.simulation, steps, time_limit=TIME_LIMIT)
    assert placed.live_bytes <= placed.arena_bytes
    arena_plan = Plan(graph.fingerprint, plan.schedule, placed.addresses)
    loss, grads, report = train_arena(helpers, model, loss_fn, batch, arena_plan, graph)
    assert report.placed > 0 and simulate(problem, plan.schedule, placed.addresses).arena_bytes == placed.arena_bytes
    assert torch.equal(loss, eager.loss)
    for k, g in grads.items():
        assert torch.equal(g, eager.grads[k]), k


def test_random_nodes_of_a_graph_loaded_from_json_are_the_captured_ones(captured):
    from memplan.runtime.format.graph import OpGraph
    from memplan.runtime.tracing.ops import random_nodes
    from memplan.runtime.policy.form import Regions

    *_, graph = captured("gpt2")
    loaded = OpGraph.from_json(graph.to_json())
    assert random_nodes(loaded) == sorted(graph.program.random_devices) != []
    assert loaded.random_nodes() == random_nodes(loaded)
    assert Problem.from_graph(loaded).random_nodes == Problem.from_graph(graph).random_nodes == \
        tuple(random_nodes(loaded))
    assert Regions.of_graph(loaded) == Regions.of_graph(graph)       # the policy form reads a plan the same way
