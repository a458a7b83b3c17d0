"""The policy form with the optimizer inside the step (runtime.apply(..., optimizer=opt)): autograd's
post-accumulate-grad hooks update each parameter by a call of its own once its gradient is accumulated
(runtime.execute.optim_step.step_in_backward), so the problem a policy plan is solved on says so
(`in_step(..., each_alone=True)`): nothing carried from one parameter's update to the next, a parameter over
1 MiB updated in slices as the executor does, each update after the whole autograd Node making its gradient.
A `selective-policy` plan solved on that problem then has the measured peak of a step (after a warm-up step
that creates the optimizer state) equal to its prediction within a scalar's bytes, and three steps of
`loss.backward()` give eager `loss.backward(); opt.step()`'s parameters and optimizer state bit for bit (tiny
GPT-2 with dropout and tied embeddings; an MLP with 2 MiB weights)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memplan import runtime
from memplan.runtime.measure.meter import PeakMeter
from memplan.runtime.format.plan import Plan, graph_provenance
from memplan.runtime.policy.apply import capture_eager
from memplan.runtime.policy.form import Regions, decisions, policy_schedule
from memplan.tasks.solve import solve
from memplan.tasks.solve.core.optimizer import in_step
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import default_schedule, simulate
from tests.runtime.test_policy import build

OPTIMIZERS = {
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01),
}


def cross_entropy(model, x, y):
    return F.cross_entropy(model(x), y)


class WideBlocks(nn.Module):
    """Two residual blocks whose weights (64 x 8192 floats, 2 MiB) the optimizer updates in 1 MiB slices."""

    def __init__(self, d: int = 64, hidden: int = 8192):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, hidden), nn.Tanh(), nn.Linear(hidden, d))
                                    for _ in range(2))
        self.out = nn.Linear(d, 8)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.out(x)


def setup(name: str):
    if name == "wide":
        torch.manual_seed(0)
        return WideBlocks(), cross_entropy, (torch.randn(64, 64), torch.randint(0, 8, (64,)))
    return build("gpt2")                          # test_policy's tiny GPT-2, dropout 0.1


def eager_steps(model, opt, loss_fn, batch, seeds):
    for seed in seeds:
        torch.manual_seed(seed)
        loss_fn(model, *batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("name", ["gpt2", "wide"])
def test_policy_plans_update_like_eager_at_the_predicted_peak(name):
    model, loss_fn, batch = setup(name)
    graph = capture_eager(model, loss_fn, batch)
    regions = Regions.of_graph(graph)
    for optimizer, build_optimizer in OPTIMIZERS.items():
        problem = in_step(Problem.from_graph(graph), graph.gradient_updates(), optimizer, each_alone=True)
        everything = simulate(problem, policy_schedule(regions, {r: frozenset() for r in regions.members}))
        solution = solve(problem, "selective-policy", everything.peak_bytes)
        assert solution.feasible, solution.message
        plan = solution.to_plan(problem)
        plan.provenance.update(graph_provenance(graph))
        assert decisions(Regions.of_graph(graph, solution.policy_split, solution.policy_nest), plan.schedule)  # recomputes
        eager, planned = copy.deepcopy(model), copy.deepcopy(model)
        eager_opt, planned_opt = build_optimizer(eager.parameters()), build_optimizer(planned.parameters())
        runtime.apply(plan, planned, loss_fn, batch, graph=graph, optimizer=planned_opt)
        eager_steps(eager, eager_opt, loss_fn, batch, range(3))
        for seed in range(3):
            torch.manual_seed(seed)                                              # eager's dropout masks
            with PeakMeter("cpu") as meter:                                       # the last: state resident
                loss_fn(planned, *batch).backward()
            assert all(p.grad is None for p in planned.parameters())
        predicted = plan.predicted["peak_bytes"]
        assert abs(meter.peak_bytes - predicted) <= 0.001 * predicted, (optimizer, meter.peak_bytes, predicted)
        for (key, want), got in zip(eager.named_parameters(), planned.parameters()):
            assert torch.equal(got, want), (optimizer, key)
        want, got = eager_opt.state_dict()["state"], planned_opt.state_dict()["state"]
        assert want.keys() == got.keys()
        for k in want:
            for key in want[k]:
                assert torch.equal(got[k][key], want[k][key]), (optimizer, k, key)
        if optimizer == "adamw" and name == "wide":       # whole 2 MiB updates would hold 4 MiB of temporaries
            whole = in_step(Problem.from_graph(graph), graph.gradient_updates(), optimizer, slice_bytes=None,
                            each_alone=True)
            assert simulate(whole, plan.schedule).peak_bytes >= meter.peak_bytes + 2 * 2**20


def test_each_parameter_is_updated_alone_as_the_problem_says():
    """A LayerNorm's weight and bias (C floats each) get their gradients from one backward op. The executor updates
    them by one AdamW call, whose loop holds the weight's scaled sqrt(v) (C) while making the bias's two
    temporaries (2C): 5C with both gradients. Autograd's hooks update them one call each: at most 4C. The
    policy form's problem predicts the measured peak; the grouped one predicts C more."""
    C = 2048
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(C), nn.Tanh())
    batches = [(torch.randn(1, C), torch.randint(0, C, (1,))) for _ in range(2)]
    graph = capture_eager(model, cross_entropy, batches[0])
    alone = in_step(Problem.from_graph(graph), graph.gradient_updates(), "adamw", each_alone=True)
    grouped = in_step(Problem.from_graph(graph), graph.gradient_updates(), "adamw")
    plan = Plan(graph.fingerprint, default_schedule(alone))
    plan.provenance.update(graph_provenance(graph))
    runtime.apply(plan, model, cross_entropy, batches[0], graph=graph,
                  optimizer=torch.optim.AdamW(model.parameters(), lr=0.01))
    cross_entropy(model, *batches[0]).backward()                 # the optimizer state now exists
    with PeakMeter("cpu") as meter:
        cross_entropy(model, *batches[1]).backward()
    predicted = simulate(alone, plan.schedule).peak_bytes
    assert abs(meter.peak_bytes - predicted) <= 8, (meter.peak_bytes, predicted)   # two float32 scalars
    assert simulate(grouped, plan.schedule).peak_bytes == 5 * C * 4 + 4 >= meter.peak_bytes + C * 4 - 16


def test_an_update_follows_the_autograd_node_that_makes_its_gradient():
    """A Linear's backward Node (AddmmBackward0) is several graph ops: the weight's `mm`, then the bias's `sum`.
    Autograd hands both gradients to AccumulateGrad, whose hook updates the parameter, once the whole Node has run,
    so the policy form's problem updates the weight after the `sum`, not after its `mm` (as the executor does)."""
    from types import SimpleNamespace

    from memplan.runtime.format.schedule import update_steps

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))
    graph = capture_eager(model, cross_entropy, (torch.randn(4, 16), torch.randint(0, 8, (4,))))
    labels = graph.meta["autograd_nodes"]

    def steps(problem):              # the default schedule computes node i at step i
        io = [SimpleNamespace(inputs=reads, outputs=made) for reads, made in zip(problem.node_inputs,
                                                                                  problem.node_outputs)]
        return update_steps(io, [(u.grads, u.params) for u in problem.updates])

    alone = steps(in_step(Problem.from_graph(graph), graph.gradient_updates(), "adamw", each_alone=True))
    grouped = steps(in_step(Problem.from_graph(graph), graph.gradient_updates(), "adamw"))
    names = [name for name, _ in model.named_parameters()]
    for name, step in zip(names, alone):
        assert step + 1 == len(labels) or labels[step + 1] != labels[step], name   # the last op of its Node
    weight, bias = names.index("0.weight"), names.index("0.bias")
    assert alone[weight] == alone[bias] == grouped[bias] > grouped[weight]
    assert graph.nodes[grouped[weight]].name.startswith("mm") and graph.nodes[alone[weight]].name.startswith("sum")
