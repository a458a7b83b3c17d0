"""The optimizer inside the step updates large parameters in elementwise slices (runtime.execute.optim_functional,
`runtime.load(..., update_slice_bytes=)`): forced on small parameters with a tiny slice bound, parameters and
optimizer state equal eager's bit for bit after three steps, and the measured peak is the planner's prediction,
lower than the whole update's by the temporaries of all but a slice."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from memplan import runtime
from memplan.runtime.measure.meter import PeakMeter
from memplan.runtime.execute.optim_functional import FUNCTIONAL
from memplan.runtime.format.plan import Plan
from memplan.runtime.format.schedule import SLICE_ALIGN, update_slices
from memplan.tasks.solve.core.optimizer import in_step
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import default_schedule, simulate
from tests.runtime.test_optim_step import BITWISE_OPTIMIZERS, ConvNet, eager_steps, loss_fn

SLICE_BYTES = 100                       # slices of 64 B: ConvNet's weights in 2 to 36 slices, its biases whole
SLICED = {"adamw", "adam-amsgrad-decay", "adamw-tensor-lr", "sgd-nesterov-decay", "sgd-dampening-maximize"}
"""The optimizers whose functional update allocates temporaries on the CPU (single-tensor kernels), so the step
slices it: Adam's and AdamW's sqrt(v), SGD's new gradient under weight decay, Nesterov or maximize (from its second
step, when the momentum buffers exist). Not SGD updating in place, foreach kernels, or classes without a functional
update (RMSprop)."""


def test_slices_are_aligned_ranges_covering_the_parameter():
    assert update_slices(1000, None) == update_slices(1000, 1000) == [(0, 1000)]
    assert update_slices(1000, 300) == [(0, 256), (256, 512), (512, 768), (768, 1000)]
    assert update_slices(200, 10) == [(0, SLICE_ALIGN), (64, 128), (128, 192), (192, 200)]


@pytest.mark.parametrize("name", sorted(BITWISE_OPTIMIZERS))
def test_sliced_updates_give_eager_parameters_and_state_bitwise(name, monkeypatch):
    torch.manual_seed(0)
    model = ConvNet()
    batches = [(torch.randn(4, 3, 8, 8), torch.randint(0, 4, (4,))) for _ in range(3)]
    graph = runtime.capture(model, loss_fn, batches[0])
    plan = Plan(graph.fingerprint, default_schedule(Problem.from_graph(graph)))
    eager, planned = copy.deepcopy(model), copy.deepcopy(model)
    build = BITWISE_OPTIMIZERS[name]
    eager_opt, plan_opt = build(eager.parameters()), build(planned.parameters())
    eager_steps(eager, eager_opt, batches)
    slices = []                          # per functional call: its tensors that are slices of a parameter
    functional = FUNCTIONAL.get(type(plan_opt))
    if functional is not None:
        monkeypatch.setitem(FUNCTIONAL, type(plan_opt), functional._replace(
            update=lambda params, *rest: (slices.append([p for p in params if not isinstance(p, nn.Parameter)]),
                                          functional.update(params, *rest))))
    step = runtime.load(plan, planned, loss_fn, graph=graph, optimizer=plan_opt, update_slice_bytes=SLICE_BYTES)
    for x, y in batches:
        step(x, y)
    pieces = [p for call in slices for p in call]
    assert bool(pieces) == (name in SLICED)
    assert all(len(call) <= 1 and p.numel() * p.element_size() <= 64 for call in slices for p in call)
    for (param_name, a), b in zip(eager.named_parameters(), planned.parameters()):
        assert torch.equal(a, b), param_name
    for k, state in eager_opt.state_dict()["state"].items():
        for key, value in state.items():
            assert torch.equal(plan_opt.state_dict()["state"][k][key], value), (k, key)


class Wide(nn.Module):
    """One large parameter whose update is the step's peak, and a small one updated after the same step: a
    convolution's weight (64 x 3 x 3 x 3 floats, 6912 B) and bias (256 B)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 64, 3)

    def forward(self, x):
        return self.conv(x).mean((2, 3))


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_sliced_update_peak_is_the_prediction_and_lower_by_the_temporaries(name):
    """Updated whole, the weight's update holds 2x its bytes (W); in slices of S each call holds 2x its slice and
    frees it on return: the peak drops by 2W - 2S (the bias, 2 x 256 B, holds less either way). The measured peak
    equals the prediction to the byte both ways."""
    torch.manual_seed(0)
    model = Wide()
    batches = [(torch.randn(1, 3, 4, 4), torch.randint(0, 64, (1,))) for _ in range(2)]
    graph = runtime.capture(model, loss_fn, batches[0])
    weight, size = model.conv.weight.numel() * 4, 1000 // SLICE_ALIGN * SLICE_ALIGN
    peaks = {}
    for slice_bytes in (None, 1000):
        problem = in_step(Problem.from_graph(graph), graph.gradient_updates(), name, slice_bytes=slice_bytes)
        plan = Plan(graph.fingerprint, default_schedule(problem))
        planned = copy.deepcopy(model)
        optimizer = getattr(torch.optim, {"adam": "Adam", "adamw": "AdamW"}[name])(planned.parameters(), lr=0.01)
        step = runtime.load(plan, planned, loss_fn, graph=graph, optimizer=optimizer, update_slice_bytes=slice_bytes)
        step(*batches[0])                                           # the optimizer state now exists
        with PeakMeter("cpu") as meter:
            step(*batches[1])
        peaks[slice_bytes] = simulate(problem, plan.schedule).peak_bytes
        assert meter.peak_bytes == peaks[slice_bytes], slice_bytes
    assert peaks[None] - peaks[1000] == 2 * weight - 2 * size


def test_a_bad_slice_size_is_refused_before_the_step():
    model = Wide()
    plan = Plan("x", [])
    for bad in (0, -5, 1.5, True):
        with pytest.raises(ValueError, match=rf"update_slice_bytes={bad!r} is not a number of bytes"):
            runtime.load(plan, model, loss_fn, optimizer=torch.optim.AdamW(model.parameters()),
                         update_slice_bytes=bad)
