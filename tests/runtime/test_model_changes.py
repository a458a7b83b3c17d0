"""Each step checks the model it runs on (runtime/execute/model_state.py): after its first step, a model whose module is
swapped, whose parameter is replaced or frozen is followed (captured again: gradients equal eager's) or refused
naming the change, in the executor form (runtime.load) and the policy form (runtime.apply)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memplan import runtime
from memplan.runtime.execute.model_state import ModelChanged
from memplan.runtime.format.plan import Plan, PlanError, graph_provenance
from memplan.runtime.policy.apply import capture_eager
from memplan.runtime.policy.form import Regions, policy_schedule
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.solution import checked_solution


class Net(nn.Module):
    """Linear -> two blocks (Linear, GELU) in an nn.Sequential (the repeated modules capture records) -> Linear."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.inp, self.out = nn.Linear(8, d), nn.Linear(d, 4)
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(d, d), nn.GELU()) for _ in range(2)))

    def forward(self, x):
        return self.out(self.blocks(self.inp(x)))


def loss_fn(model, x, y):
    return F.cross_entropy(model(x), y)


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    return Net(), (torch.randn(6, 8), torch.randint(0, 4, (6,)))


def grads(model, batch, step=None):
    """Every parameter's gradient after one step from no gradients (eager's without `step`)."""
    model.zero_grad(set_to_none=True)
    if step is None:
        loss_fn(model, *batch).backward()
    else:
        step(*batch)
    return {k: p.grad for k, p in model.named_parameters()}


def assert_grads_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if a[k] is None or b[k] is None:
            assert a[k] is None and b[k] is None, k
        else:
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"grad {k}: {m}")


def replace_weight(model):
    model.blocks[0][0].weight = nn.Parameter(2 * model.blocks[0][0].weight.detach())


def loaded(setup, helpers):
    """A copy of the model and its executor step (a recomputation plan) after one step."""
    model, batch = copy.deepcopy(setup[0]), setup[1]
    graph = runtime.capture(model, loss_fn, batch)
    step = runtime.load(Plan(graph.fingerprint, helpers.recompute_schedule(graph, helpers.chen_sqrt_n_drop(graph))),
                        model, loss_fn, graph=graph)
    step(*batch)
    return model, step


def test_executor_refuses_a_swapped_module_whose_graph_the_plan_does_not_fit(setup, helpers):
    model, step = loaded(setup, helpers)
    model.blocks[1][1] = nn.Tanh()
    with pytest.raises(PlanError, match=r"the model changed since this step captured it \(module 'blocks.1.1' is "
                                        r"now Tanh, was GELU\), so the step captured it again, and the plan does not "
                                        r"fit the new graph: plan fingerprint"):
        step(*setup[1])
    model.blocks[1][1] = nn.GELU()                  # another module of the same graph: captured again, runs
    assert_grads_equal(grads(model, setup[1], step), grads(copy.deepcopy(model), setup[1]))


def test_executor_uses_a_replaced_parameter(setup, helpers):
    model, step = loaded(setup, helpers)
    replace_weight(model)
    assert_grads_equal(grads(model, setup[1], step), grads(copy.deepcopy(model), setup[1]))


def test_executor_refuses_a_frozen_parameter_and_leaves_its_grad(setup, helpers):
    model, step = loaded(setup, helpers)
    model.zero_grad(set_to_none=True)
    model.blocks[0][0].weight.requires_grad_(False)
    with pytest.raises(ModelChanged, match=r"parameter 'blocks.0.0.weight' no longer requires grad since this step "
                                           r"captured the model: .* make it require grad again"):
        step(*setup[1])
    assert all(p.grad is None for p in model.parameters())


def test_executor_names_a_reshaped_parameter(setup, helpers):
    model, step = loaded(setup, helpers)
    model.out.bias = nn.Parameter(torch.zeros(1))              # broadcast: the step captures, to another graph
    with pytest.raises(PlanError, match=r"parameter 'out.bias' is now \[1\] float32 on cpu \(a new tensor\), "
                                        r"was \[4\] float32 on cpu"):
        step(*setup[1])


@pytest.fixture(scope="module")
def policy_plan(setup):
    """A policy plan of the model checkpointing each block whole, and its graph."""
    model, batch = setup
    graph = capture_eager(model, loss_fn, batch)
    problem, regions = Problem.from_graph(graph), Regions.of_graph(graph)
    schedule = policy_schedule(regions, {r: frozenset() for r in regions.members})
    plan = checked_solution(problem, "selective-policy", 2**62, schedule, form="policy").to_plan(problem)
    plan.provenance.update(graph_provenance(graph))
    assert len(plan.schedule) > len(graph.nodes)                 # it recomputes
    return plan, graph


def applied(setup, policy_plan):
    model = runtime.apply(policy_plan[0], copy.deepcopy(setup[0]), loss_fn, setup[1], graph=policy_plan[1])
    grads(model, setup[1])
    return model


def test_policy_form_refuses_a_swapped_module(setup, policy_plan):
    model = applied(setup, policy_plan)
    model.blocks[1][1] = nn.Tanh()
    with pytest.raises(ModelChanged, match=r"the model's modules changed since runtime.apply captured it \(module "
                                           r"'blocks.1.1' is now Tanh, was GELU\): .* a plan made for the changed"):
        grads(model, setup[1])


@pytest.mark.parametrize("change", ["replaced", "frozen"])
def test_policy_form_follows_a_parameter_change_as_autograd_does(setup, policy_plan, change):
    model, reference = applied(setup, policy_plan), copy.deepcopy(setup[0])
    for m in (model, reference):
        if change == "replaced":
            replace_weight(m)
        else:
            m.blocks[0][0].weight.requires_grad_(False)
    result = grads(model, setup[1])
    assert_grads_equal(result, grads(reference, setup[1]))
    assert (result["blocks.0.0.weight"] is None) == (change == "frozen")
