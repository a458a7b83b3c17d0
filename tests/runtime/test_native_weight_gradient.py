"""Rule `native` (a convolution's weight gradient by ATen's native CPU kernel, oneDNN off) and the update order
(`tasks.solve.core.orders.update_order`: each convolution's input gradient before its weight gradient), the two
the optimizer inside the step needs to reach its target on resnet18 (issue 34): the variant's gradients equal
oneDNN's within the fp32 tolerance, a plan running both trains like eager with the optimizer inside the step,
the weight is updated in the step that makes its gradient, and the measured peak is the simulated one."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memplan import runtime
from memplan.runtime.measure.meter import PeakMeter
from memplan.runtime.format.plan import Plan
from memplan.runtime.variants.kernels import convolution_backward_native
from memplan.runtime.variants.offered import graph_variants
from memplan.tasks.solve.core.optimizer import in_step
from memplan.tasks.solve.core.orders import update_order
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import simulate

aten = torch.ops.aten


def loss_fn(model, x, y):
    return F.cross_entropy(model(x), y)


@pytest.fixture(scope="module")
def conv_net():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2, padding=1),
                          nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1, bias=False), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(32, 10))
    batches = [(torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))) for _ in range(3)]
    graph = runtime.capture(model, loss_fn, batches[0])
    weight_grads = [n.id for n in graph.nodes if n.targets[0] == "aten.convolution_backward.default"]
    return model, batches, graph, weight_grads


def test_native_kernel_is_within_tolerance_of_onednns_and_restores_the_flag():
    torch.manual_seed(0)
    x, grad, weight = torch.randn(8, 64, 6, 6), torch.randn(8, 128, 3, 3), torch.randn(128, 64, 3, 3)
    args = (grad, x, weight, None, [2, 2], [1, 1], [1, 1], False, [0, 0], 1, [False, True, False])
    assert torch._C._get_mkldnn_enabled()
    got = convolution_backward_native(*args)
    want = aten.convolution_backward.default(*args)
    assert got[0] is None and got[2] is None
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-5)
    with pytest.raises(RuntimeError):
        convolution_backward_native(grad, x[:, :3], *args[2:])               # channels do not match the weight
    assert torch._C._get_mkldnn_enabled()                                    # restored after the error too


def test_offered_on_every_weight_gradient_and_a_plan_running_it_trains_like_eager(conv_net, helpers):
    """Offered on each weight-gradient convolution backward (the split ones and the first layer's, whose input
    needs no gradient) and nowhere else; the same values and bytes as the default; a plan running it on all of
    them gives eager's gradients within the fp32 tolerance, at the simulated peak."""
    model, batches, graph, weight_grads = conv_net
    variants = graph_variants(graph, ("native",))
    assert sorted(variants.specs) == weight_grads and len(weight_grads) == 3
    for node in weight_grads:
        spec = variants.specs[node]["native"]
        assert spec.outputs == graph.nodes[node].outputs and set(spec.inputs) == set(graph.nodes[node].inputs)
    schedule = [{"compute": n.id, "impl": "native"} if n.id in weight_grads else {"compute": n.id}
                for n in graph.nodes]
    eager = helpers.train_eager(model, loss_fn, batches[0])
    planned = helpers.train_plan(model, loss_fn, batches[0], Plan(graph.fingerprint, schedule), graph=graph)
    helpers.assert_same_step(eager, planned)
    helpers.assert_peak_matches(planned.peak, simulate(Problem.from_graph(graph, None, variants), schedule).peak_bytes)


def _topological(problem: Problem, order: np.ndarray) -> bool:
    position = {int(node): k for k, node in enumerate(order)}
    return sorted(position) == list(range(problem.num_nodes)) and all(
        problem.value_producer[v] < 0 or position[int(problem.value_producer[v])] < position[node]
        for node in range(problem.num_nodes) for v in problem.node_inputs[node])


@pytest.mark.parametrize("optimizer", ["sgd-momentum", "adamw"])
def test_update_order_updates_each_weight_with_its_gradient_at_the_measured_peak(conv_net, optimizer):
    """The update order is topological and runs each convolution's input gradient (a backward `aten.convolution`
    reading the weight) before the weight gradient: with the optimizer inside the step each split weight's
    gradient then dies in the step that makes it (in the default order it lives one step more). A plan of that
    order running the native variant trains like eager for 3 steps, and the meter's peak is the simulator's."""
    model, batches, graph, weight_grads = conv_net
    problem = in_step(Problem.from_graph(graph, None, graph_variants(graph, ("native",))), graph.gradient_updates(),
                      optimizer)
    order = update_order(problem)
    assert _topological(problem, order) and not np.array_equal(order, problem.order)
    position = {int(node): k for k, node in enumerate(order)}
    input_grads = {n.id: n.inputs[0] for n in graph.nodes if n.phase == "backward"
                   and n.targets[0] == "aten.convolution.default"}
    split = [w for w in weight_grads if any(g == graph.nodes[w].inputs[0] for g in input_grads.values())]
    assert len(split) == 2 and len(input_grads) == 2
    for node, grad in input_grads.items():
        weight_grad = next(w for w in split if graph.nodes[w].inputs[0] == grad)
        assert position[node] < position[weight_grad]

    schedule = [("compute", int(n), "native") if int(n) in weight_grads else ("compute", int(n)) for n in order]
    for steps, lives in ((schedule, 0), ([("compute", int(n)) for n in problem.order], 1)):
        sim = simulate(problem, steps)
        for w in split:
            grad = graph.nodes[w].outputs[0]
            (copy_,) = np.flatnonzero(sim.copy_value == grad)
            assert sim.copy_end[copy_] - sim.copy_start[copy_] == lives

    make = {"sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
            "adamw": lambda p: torch.optim.AdamW(p, lr=0.01)}[optimizer]
    eager, planned = copy.deepcopy(model), copy.deepcopy(model)
    eager_opt = make(eager.parameters())
    step = runtime.load(Plan(graph.fingerprint, schedule), planned, loss_fn, graph=graph,
                        optimizer=make(planned.parameters()))
    for i, (x, y) in enumerate(batches):
        loss_fn(eager, x, y).backward()
        eager_opt.step()
        eager_opt.zero_grad(set_to_none=True)
        if i == 1:                                                   # the optimizer state exists from step 1 on
            with PeakMeter("cpu") as meter:
                step(x, y)
        else:
            step(x, y)
    for (name, a), b in zip(eager.named_parameters(), planned.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    assert meter.peak_bytes == simulate(problem, schedule).peak_bytes
