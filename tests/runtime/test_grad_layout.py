"""Gradients whose layout differs from their parameter's: the executor gives `.grad` eager's values and
eager's layout (autograd's AccumulateGrad: the parameter's strides) and adds each later step's gradient
into it (no `zero_grad`), under the eager-order plan and under a recomputing plan."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memplan import runtime
from memplan.runtime.format.plan import Plan


class ChannelsLastConv(nn.Module):
    """A convolution whose weight (and input) are channels_last: a (O, I, kH, kW) weight with strides of
    an (O, kH, kW, I) tensor."""

    def __init__(self):
        super().__init__()
        self.conv, self.head = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8, 4)
        self.conv.to(memory_format=torch.channels_last)

    def forward(self, x):
        return self.head(torch.tanh(self.conv(x.contiguous(memory_format=torch.channels_last))).mean((2, 3)))


class TransposedWeight(nn.Module):
    """A linear layer whose weight parameter is the transpose of a contiguous tensor (strides (1, 8)): the
    gradient mm computes is row-major."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 16).t())
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(torch.tanh(x @ self.weight.t()))


class BroadcastGradient(nn.Module):
    """`scale` (a transposed tensor, strides (1, 2)) enters only through its sum: its gradient is a broadcast
    (stride-0) expansion of one number."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(8, 2).t())
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(torch.tanh(x * self.scale.sum()))


class SlicedGradient(nn.Module):
    """`top` and `bottom` enter only through their concatenation: their gradients are slices of one buffer
    (the second at a non-zero offset)."""

    def __init__(self):
        super().__init__()
        self.top, self.bottom = nn.Parameter(torch.randn(4, 8)), nn.Parameter(torch.randn(4, 8))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(torch.tanh(x @ torch.cat([self.top, self.bottom]).t()))


def cross_entropy(model, x, y):
    return F.cross_entropy(model(x), y)


MODELS = {"channels_last_conv": (ChannelsLastConv, (6, 3, 5, 5)), "transposed_weight": (TransposedWeight, (6, 8)),
          "broadcast_gradient": (BroadcastGradient, (6, 8)), "sliced_gradient": (SlicedGradient, (6, 8))}


def batches(shape, steps=2):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(shape, generator=generator), torch.randint(0, 4, (shape[0],), generator=generator))
            for _ in range(steps)]


def recompute_forward(graph) -> Plan:
    """Frees every forward activation the backward reads after its last forward use and recomputes it
    (with what it needs) right before the backward node that reads it."""
    backward = [n for n in graph.nodes if n.phase == "backward"]
    forward = [n for n in graph.nodes if n.phase != "backward"]
    read_later = {v for n in backward for v in n.inputs}
    last_read = {v: n.id for n in forward for v in n.inputs}
    steps, resident = [], {v.id for v in graph.values if v.producer is None}

    def compute(node):
        for v in node.inputs:
            if v not in resident:
                compute(graph.nodes[graph.values[v].producer])
        steps.append(("compute", node.id))
        resident.update(node.outputs)

    for node in forward:
        compute(node)
        for v in [v for n in forward for v in n.outputs if last_read.get(v) == node.id and v in read_later
                  and graph.values[v].kind == "activation"]:
            steps.append(("free", v))
            resident.discard(v)
    for node in backward:
        compute(node)
    return Plan(graph.fingerprint, steps)


@pytest.mark.parametrize("name", list(MODELS))
def test_gradients_get_eager_values_and_layout_and_accumulate(name):
    make, shape = MODELS[name]
    torch.manual_seed(0)
    model = make()
    data = batches(shape)
    graph = runtime.capture(model, cross_entropy, data[0])
    recompute = recompute_forward(graph)
    assert len(recompute.compute_steps()) > len(graph.nodes)
    for plan in (runtime.default_plan(graph), recompute):
        planned, eager = copy.deepcopy(model), copy.deepcopy(model)
        step = runtime.load(plan, planned, cross_entropy, graph=graph)
        for i, batch in enumerate(data):                    # no zero_grad: every step adds to .grad, in place
            loss = step(*batch)
            expected = cross_entropy(eager, *batch)
            expected.backward()
            torch.testing.assert_close(loss, expected, rtol=0, atol=0)
            for (param, p), q in zip(planned.named_parameters(), eager.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6, msg=lambda m: f"{param}: {m}")
                assert p.grad.stride() == q.grad.stride() == p.stride(), param
            if i == 0:
                first = [p.grad for p in planned.parameters()]
            assert all(p.grad is g for p, g in zip(planned.parameters(), first))


class SummedParameters(nn.Module):
    """`a` and `b` enter only as `a + b` (`scaled`: as `a + b * 1`)."""

    def __init__(self, scaled: bool):
        super().__init__()
        self.a, self.b, self.scaled = nn.Parameter(torch.randn(8, 8)), nn.Parameter(torch.randn(8, 8)), scaled
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(torch.tanh(x @ (self.a + (self.b * 1 if self.scaled else self.b))))


def test_parameters_sharing_one_gradient_tensor_get_a_clear_capture_error():
    from memplan.runtime.tracing.capture import CaptureError

    with pytest.raises(CaptureError, match=r"two parameters receive the very same gradient tensor .*\(`a \+ b \* 1`\)"):
        runtime.capture(SummedParameters(scaled=False), cross_entropy, batches((6, 8), 1)[0])
    model = SummedParameters(scaled=True)                  # the workaround the message names captures
    eager, batch = copy.deepcopy(model), batches((6, 8), 1)[0]
    runtime.load(runtime.default_plan(runtime.capture(model, cross_entropy, batch)), model, cross_entropy)(*batch)
    cross_entropy(eager, *batch).backward()
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6)
