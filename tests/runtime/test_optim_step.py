"""The optimizer inside the step (runtime.load(..., optimizer=opt)): the parameters after three steps equal
eager's (loss.backward(); opt.step() with a second copy of the optimizer), the user's optimizer keeps its
state and hyperparameters, the measured peak is the simulator's prediction, and what cannot apply is
refused in one paragraph."""

from __future__ import annotations

import copy
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from memplan import runtime
from memplan.runtime.measure.meter import PeakMeter
from memplan.runtime.format.plan import Plan
from memplan.tasks.solve.core.optimizer import in_step
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import simulate

OPTIMIZERS = {
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01),
}


def loss_fn(model, x, y):
    return F.cross_entropy(model(x), y)


@pytest.fixture(scope="module")
def setup(helpers):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(),
                          nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    batches = [(torch.randn(6, 8), torch.randint(0, 4, (6,))) for _ in range(3)]
    graph = runtime.capture(model, loss_fn, batches[0])
    forward = [n.id for n in graph.nodes if n.phase == "forward"]
    plan = Plan(graph.fingerprint, helpers.recompute_schedule(graph, set(forward[:-2])))
    assert len(plan.compute_steps()) > len(graph.nodes)           # it recomputes
    return model, batches, graph, plan


def eager_steps(model, opt, batches, scheduler=None):
    for x, y in batches:
        loss_fn(model, x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_parameters_after_three_steps_equal_eager(setup, name):
    model, batches, graph, plan = setup
    eager, planned = copy.deepcopy(model), copy.deepcopy(model)
    eager_opt, plan_opt = OPTIMIZERS[name](eager.parameters()), OPTIMIZERS[name](planned.parameters())
    eager_steps(eager, eager_opt, batches)
    step = runtime.load(plan, planned, loss_fn, graph=graph, optimizer=plan_opt)
    for x, y in batches:
        step(x, y)
    assert all(p.grad is None for p in planned.parameters())
    for (name_, a), b in zip(eager.named_parameters(), planned.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name_}: {m}")
    for a, b in zip(eager.buffers(), planned.buffers()):
        torch.testing.assert_close(b, a)
    eager_state, plan_state = eager_opt.state_dict(), plan_opt.state_dict()   # the user's optimizer holds the state
    assert eager_state["state"].keys() == plan_state["state"].keys() and eager_state["state"]
    for k, state in eager_state["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(plan_state["state"][k][key], value, rtol=1e-5, atol=1e-6)


def test_lr_scheduler_param_groups_and_loaded_state_apply(setup):
    """An LR scheduler stepping the user's optimizer, two param groups, a parameter the optimizer does not hold
    (it gets its .grad as without the optimizer) and a state loaded in between: all as eager."""
    model, batches, graph, plan = setup
    eager, planned = copy.deepcopy(model), copy.deepcopy(model)

    def build(m):
        opt = torch.optim.SGD([{"params": [m[0].weight, m[0].bias]},
                               {"params": [p for i in (3, 5, 7) for p in m[i].parameters()], "lr": 0.05}],
                              lr=0.1, momentum=0.9)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    (eager_opt, eager_sched), (plan_opt, plan_sched) = build(eager), build(planned)
    step = runtime.load(plan, planned, loss_fn, graph=graph, optimizer=plan_opt)
    for i, (x, y) in enumerate(batches):
        loss_fn(eager, x, y).backward()
        eager_opt.step()
        bn_grads = [p.grad.clone() for p in eager[1].parameters()]
        eager.zero_grad(set_to_none=True)
        eager_sched.step()
        with pytest.warns(UserWarning) if i == 0 else nullcontext():
            step(x, y)
            plan_sched.step()                  # warns once: the user never calls plan_opt.step()
        for p, g in zip(planned[1].parameters(), bn_grads):
            torch.testing.assert_close(p.grad, g)
        planned.zero_grad(set_to_none=True)
        if i == 1:
            plan_opt.load_state_dict(copy.deepcopy(eager_opt.state_dict()))
    for a, b in zip(eager.parameters(), planned.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_clip_grad_value_is_exact_per_parameter(setup):
    model, batches, graph, plan = setup
    eager, planned = copy.deepcopy(model), copy.deepcopy(model)
    eager_opt, plan_opt = OPTIMIZERS["adamw"](eager.parameters()), OPTIMIZERS["adamw"](planned.parameters())
    step = runtime.load(plan, planned, loss_fn, graph=graph, optimizer=plan_opt, clip_grad_value=0.01)
    for x, y in batches:
        loss_fn(eager, x, y).backward()
        torch.nn.utils.clip_grad_value_(eager.parameters(), 0.01)
        eager_opt.step()
        eager_opt.zero_grad(set_to_none=True)
        step(x, y)
    for a, b in zip(eager.parameters(), planned.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_measured_peak_is_the_prediction(setup, name):
    """On CPU the meter counts what the memory model counts: the peak is the prediction to the byte, with SGD's
    in-place update and with AdamW's temporaries (2x the parameter's bytes while it is updated); with SGD it is
    lower than the same plan's with the optimizer outside."""
    model, batches, graph, plan = setup
    planned = copy.deepcopy(model)
    step = runtime.load(plan, planned, loss_fn, graph=graph, optimizer=OPTIMIZERS[name](planned.parameters()))
    step(*batches[0])                                           # the optimizer state now exists
    with PeakMeter("cpu") as meter:
        step(*batches[1])
    problem = in_step(Problem.from_graph(graph), graph.gradient_updates(), name)
    predicted = simulate(problem, plan.schedule).peak_bytes
    assert meter.peak_bytes == predicted
    if name == "sgd-momentum":              # (AdamW's scratch outweighs this tiny model's gradients)
        assert predicted < simulate(Problem.from_graph(graph), plan.schedule).peak_bytes


def test_gradients_cannot_accumulate_across_steps(setup):
    model, batches, graph, plan = setup
    planned = copy.deepcopy(model)
    step = runtime.load(plan, planned, loss_fn, graph=graph, optimizer=OPTIMIZERS["adamw"](planned.parameters()))
    planned[0].weight.grad = torch.zeros_like(planned[0].weight)
    with pytest.raises(ValueError, match=r"cannot accumulate across steps .*optimizer.zero_grad\(\)"):
        step(*batches[0])


def test_global_norm_clipping_and_unsupported_optimizers_are_refused(setup):
    model, batches, graph, plan = setup
    params = list(model.parameters())
    with pytest.raises(ValueError, match=r"clip_grad_norm=1.0 cannot apply .*clip_grad_value="):
        runtime.load(plan, model, loss_fn, optimizer=torch.optim.SGD(params), clip_grad_norm=1.0)
    with pytest.raises(ValueError, match=r"optimizer LBFGS cannot run inside the step"):
        runtime.load(plan, model, loss_fn, optimizer=torch.optim.LBFGS(params))
    with pytest.raises(ValueError, match=r"differentiable=True"):
        runtime.load(plan, model, loss_fn, optimizer=torch.optim.SGD(params, differentiable=True))
    with pytest.raises(TypeError, match=r"torch.optim.Optimizer"):
        runtime.load(plan, model, loss_fn, optimizer=params)
    with pytest.raises(ValueError, match=r"got no optimizer="):
        runtime.load(plan, model, loss_fn, clip_grad_value=1.0)


class ConvNet(nn.Module):
    """Convolutions with biases and batch norms: their backward nodes make two gradients each, updated together."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.body(x).mean((2, 3)))


BITWISE_OPTIMIZERS = {
    **OPTIMIZERS,
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1),
    "sgd-nesterov-decay": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True,
                                                         weight_decay=0.01),
    "sgd-dampening-maximize": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, dampening=0.5,
                                                             maximize=True),
    "adam-amsgrad-decay": lambda params: torch.optim.Adam(params, lr=0.01, amsgrad=True, weight_decay=0.01),
    "adamw-foreach": lambda params: torch.optim.AdamW(params, lr=0.01, foreach=True),
    "adamw-tensor-lr": lambda params: torch.optim.AdamW(params, lr=torch.tensor(0.01)),
    "rmsprop": lambda params: torch.optim.RMSprop(params, lr=0.01, momentum=0.5),
}


@pytest.mark.parametrize("name", sorted(BITWISE_OPTIMIZERS))
def test_grouped_updates_give_eager_parameters_bitwise(name, monkeypatch):
    """The parameters updated after the same schedule step are updated together (fewer updates than parameters):
    for SGD, Adam and AdamW by the class's functional update (runtime.execute.optim_functional) once their state exists,
    before that (Adam's first step) and for other classes by one `step()` of the class over them. After three
    steps every parameter and optimizer state equals eager's bit for bit."""
    from memplan.runtime.execute.optim_functional import FUNCTIONAL
    from memplan.runtime.execute.optim_step import update_points
    from memplan.tasks.solve.core.simulator import default_schedule

    torch.manual_seed(0)
    model = ConvNet()
    batches = [(torch.randn(4, 3, 8, 8), torch.randint(0, 4, (4,))) for _ in range(3)]
    graph = runtime.capture(model, loss_fn, batches[0])
    problem = in_step(Problem.from_graph(graph), graph.gradient_updates(), "adamw")    # (points: any optimizer)
    plan = Plan(graph.fingerprint, default_schedule(problem))
    points = update_points(graph, plan, plan.validate(graph), range(len(problem.updates)))
    eager, planned = copy.deepcopy(model), copy.deepcopy(model)
    build = BITWISE_OPTIMIZERS[name]
    eager_opt, plan_opt = build(eager.parameters()), build(planned.parameters())
    eager_steps(eager, eager_opt, batches)
    functional_calls = []
    functional = FUNCTIONAL.get(type(plan_opt))
    if functional is not None:
        monkeypatch.setitem(FUNCTIONAL, type(plan_opt), functional._replace(
            update=lambda params, *rest: (functional_calls.append(len(params)), functional.update(params, *rest))))
    step = runtime.load(plan, planned, loss_fn, graph=graph, optimizer=plan_opt)
    step_calls = []
    handle = register_optimizer_step_post_hook(lambda opt, *_: step_calls.append(opt))
    try:
        for x, y in batches:
            step(x, y)
    finally:
        handle.remove()
    assert len(points) < len(list(model.parameters()))
    first_steps = 0 if functional is None or name.startswith("sgd") else 1       # Adam's first step makes state
    expected_functional = 0 if functional is None else 3 - first_steps
    assert (len(step_calls), len(functional_calls)) == ((3 - expected_functional) * len(points),
                                                        expected_functional * len(points))
    for (param_name, a), b in zip(eager.named_parameters(), planned.parameters()):
        assert torch.equal(a, b), param_name
    for k, state in eager_opt.state_dict()["state"].items():
        for key, value in state.items():
            assert torch.equal(plan_opt.state_dict()["state"][k][key], value), (k, key)


@pytest.mark.parametrize("foreach", [False, True])
def test_grouped_update_scratch_is_the_prediction(foreach):
    """A LayerNorm's weight and bias (C floats each) are updated after its backward by one AdamW step: its
    single-tensor loop holds the weight's scaled sqrt(v) (C) while making the bias's sqrt(v) and its scaled copy
    (2C), its foreach kernels sqrt(v) of both at once (2C). With the two gradients and the 4-byte loss, the
    measured peak is (5C or 4C) * 4 + 4 bytes, and the simulator predicts it to the byte."""
    from memplan.tasks.solve.core.simulator import default_schedule

    torch.manual_seed(0)
    C = 2048
    model = nn.Sequential(nn.LayerNorm(C), nn.Tanh())
    batches = [(torch.randn(1, C), torch.randint(0, C, (1,))) for _ in range(2)]
    graph = runtime.capture(model, loss_fn, batches[0])
    problem = in_step(Problem.from_graph(graph), graph.gradient_updates(), "adamw", foreach)
    plan = Plan(graph.fingerprint, default_schedule(problem))
    step = runtime.load(plan, model, loss_fn, graph=graph,
                        optimizer=torch.optim.AdamW(model.parameters(), lr=0.01, foreach=foreach))
    step(*batches[0])                                           # the optimizer state now exists
    with PeakMeter("cpu") as meter:
        step(*batches[1])
    assert meter.peak_bytes == simulate(problem, plan.schedule).peak_bytes == (4 if foreach else 5) * C * 4 + 4
