"""Implementation variants in the executor: the `mask` variant of ReLU / hardtanh trains exactly like eager
PyTorch, its measured peak is the simulated one, and inconsistent variant plans are refused."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memplan import runtime
from memplan.runtime.format.plan import Plan, PlanError
from memplan.runtime.variants.ops import VariantError
from memplan.runtime.variants.offered import graph_variants
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import InvalidSchedule, simulate

_CAPTURES = {}


def small_cnn(name):
    """(model, loss_fn, batch, graph) of a torchvision model, 10 classes, batch 2x3x32x32; captured once, with the
    rewrites that are bit-identical here (`verify=True`): on an AVX-512 Xeon, 8 of MobileNet-V2's 34 pointwise
    input gradients computed as matrix products (`pointwise_input_gradient`) differ from eager's convolution
    backward in the last bits, on an AMD EPYC none does, and these tests compare steps with eager's bit for bit."""
    if name not in _CAPTURES:
        import torchvision
        torch.manual_seed(0)
        model = getattr(torchvision.models, name)(num_classes=10)
        loss_fn = lambda m, x, y: F.cross_entropy(m(x), y)  # noqa: E731
        batch = (torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,)))
        _CAPTURES[name] = (model, loss_fn, batch, runtime.capture(model, loss_fn, batch, verify=True))
    return _CAPTURES[name]


def mask_schedule(graph):
    """The default order, every node that offers `mask` run as `mask`."""
    variants = graph_variants(graph)
    return [{"compute": n.id, "impl": "mask"} if "mask" in variants.specs.get(n.id, {}) else {"compute": n.id}
            for n in graph.nodes]


def assert_equal_step(a, b):
    assert torch.equal(a.loss, b.loss)
    assert a.grads.keys() == b.grads.keys() and a.buffers.keys() == b.buffers.keys()
    for k in a.grads:
        assert torch.equal(a.grads[k], b.grads[k]), k
    for k in a.buffers:
        assert torch.equal(a.buffers[k], b.buffers[k]), k


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2"])
def test_mask_plan_trains_exactly_like_eager_at_the_simulated_peak(helpers, name):
    model, loss_fn, batch, g = small_cnn(name)
    variants = graph_variants(g)
    schedule = mask_schedule(g)
    masks = [v for v in variants.values if v.name.endswith(".zero_mask")]
    assert sum(1 for s in schedule if "impl" in s) >= 2 * len(masks)   # forward and backward
    result = helpers.train_plan(model, loss_fn, batch, Plan(g.fingerprint, schedule), graph=g)
    assert_equal_step(helpers.train_eager(model, loss_fn, batch), result)
    problem = Problem.from_graph(g, None, variants)
    masked, default = simulate(problem, schedule), simulate(problem, runtime.default_plan(g).schedule)
    helpers.assert_peak_matches(result.peak, masked.peak_bytes)
    if name == "mobilenet_v2":      # ReLU6 saves a clone of its input for the backward: the mask replaces it
        assert masked.peak_bytes < default.peak_bytes
    # resnet18 gains nothing: each ReLU output is also the next convolution's saved input, so the mask only
    # adds memory (and at 32x32 the peak is the end of the backward, on its 45 MB of gradients)


def test_backward_mask_without_the_forward_mask_is_refused():
    model, loss_fn, batch, g = small_cnn("resnet18")
    variants = graph_variants(g)
    schedule = [dict(s) for s in mask_schedule(g)]
    for s in schedule:
        if g.nodes[s["compute"]].phase != "backward":
            s.pop("impl", None)
    plan = Plan(g.fingerprint, schedule)
    with pytest.raises(PlanError, match="has not been computed by a variant that allocates it"):
        plan.validate(g, variants)
    with pytest.raises(PlanError, match="has not been computed by a variant that allocates it"):
        runtime.load(plan, copy.deepcopy(model), loss_fn, graph=g)(*batch)


class TinyReLU6(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.l2(F.relu6(self.l1(x)) + F.relu(self.l1(x)))


def tiny_graph():
    torch.manual_seed(0)
    model = TinyReLU6()
    loss_fn = lambda m, x, y: F.cross_entropy(m(x), y)  # noqa: E731
    batch = (torch.randn(6, 8), torch.randint(0, 4, (6,)))
    return model, loss_fn, batch, runtime.capture(model, loss_fn, batch)


def same(a, b):
    """Bit-equal values, NaNs in the same places."""
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    return True


def test_variant_function_computes_the_variant_values():
    model, loss_fn, batch, g = tiny_graph()
    variants = graph_variants(g)
    by_target = {g.nodes[n].targets[0]: n for n in variants.specs}
    x = torch.tensor([-2.0, -1.0, -0.5, -0.0, 0.0, 0.5, 1.0, 6.0, 7.0, float("nan")]).repeat(6, 2)[:, :16]
    grad = torch.randn(6, 16)
    relu = by_target["aten.relu.default"]
    out, mask = runtime.variant_function(g, relu, "mask")(x)
    assert same(out, torch.relu(x)) and same(mask, torch.relu(x) <= 0)
    (result,) = runtime.variant_function(g, by_target["aten.threshold_backward.default"], "mask")(grad, mask)
    assert same(result, torch.ops.aten.threshold_backward(grad, out, 0))
    # ATen's CPU hardtanh_backward is not consistent on NaN (0 in its vectorized loop, grad in its scalar
    # tail), so the hardtanh check uses finite inputs
    x = torch.nan_to_num(x, nan=3.0)
    hardtanh = by_target["aten.hardtanh.default"]
    out, mask = runtime.variant_function(g, hardtanh, "mask")(x)
    assert same(out, F.hardtanh(x, 0.0, 6.0)) and same(mask, (x <= 0) | (x >= 6))
    backward = by_target["aten.hardtanh_backward.default"]
    assert variants.specs[backward]["mask"].inputs[1] == variants.specs[hardtanh]["mask"].outputs[-1]
    (result,) = runtime.variant_function(g, backward, "mask")(grad, mask)
    assert same(result, torch.ops.aten.hardtanh_backward(grad, x, 0.0, 6.0))
    assert runtime.variant_function(g, backward, "default").code == runtime.node_function(g, backward).code


def test_hardtanh_backward_with_other_bounds_than_its_forward_is_refused():
    model, loss_fn, batch, g = tiny_graph()
    variants = graph_variants(g)
    backward = next(n for n in variants.specs if g.nodes[n].targets[0] == "aten.hardtanh_backward.default")
    head = next(m for m in g.program.groups[backward] if m.name == g.nodes[backward].name)
    head.args = (*head.args[:2], -1.0, 6.0)              # as if the backward clipped at other bounds
    plan = Plan(g.fingerprint, mask_schedule(g))
    with pytest.raises(VariantError, match=r"min/max \(-1.0, 6.0\).*min/max \(0, 6\)"):
        runtime.load(plan, copy.deepcopy(model), loss_fn, graph=g)(*batch)


class ConvBnReLU(nn.Module):
    """conv-bn-relu, then conv-bn whose output is read by a ReLU and by the residual add (so that ReLU may
    not run in place), then a linear head."""

    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2, self.b2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        h = self.b2(self.c2(F.relu(self.b1(self.c1(x)))))
        return self.fc((F.relu(h) + h).mean((2, 3)))


def in_place_schedule(graph, variants, impl="inplace"):
    """The default order, every ReLU that offers `impl` run as it (a mask variant's backward as `mask` or
    `bitmask`)."""
    rule = impl.removesuffix("-inplace") if impl != "inplace" else None
    masks = {v for specs in variants.specs.values() for s in specs.values() if s.name == impl for v in s.outputs}
    steps = []
    for n in graph.nodes:
        specs = variants.specs.get(n.id, {})
        if impl in specs:
            steps.append({"compute": n.id, "impl": impl})
        elif rule in specs and masks & set(specs[rule].inputs):
            steps.append({"compute": n.id, "impl": rule})
        else:
            steps.append({"compute": n.id})
    return steps


@pytest.mark.filterwarnings("ignore:arena mode")            # copies of steps without an out= kernel: expected
def test_in_place_relu_trains_exactly_like_eager_at_the_simulated_peak_and_in_arena_mode(helpers):
    from memplan.tasks.solve.core.addresses import greedy_addresses

    torch.manual_seed(0)
    model = ConvBnReLU()
    loss_fn = lambda m, x, y: F.cross_entropy(m(x), y)  # noqa: E731
    batch = (torch.randn(4, 3, 16, 16), torch.randint(0, 4, (4,)))
    g = runtime.capture(model, loss_fn, batch, verify=True)       # compared with eager bit for bit (small_cnn)
    variants = graph_variants(g)
    relus = [n.id for n in g.nodes if n.targets[0] == "aten.relu.default"]
    assert len(relus) == 2
    # the first ReLU's input (a BatchNorm output) is read by it alone; the second's also by the add
    assert {"inplace", "mask-inplace", "bitmask-inplace"} <= set(variants.specs[relus[0]])
    assert not any(s.overwrites for s in variants.specs.get(relus[1], {}).values())
    x = g.nodes[relus[0]].inputs[0]
    assert variants.specs[relus[0]]["inplace"].overwrites == ((g.nodes[relus[0]].outputs[0], x),)
    problem = Problem.from_graph(g, None, variants)
    default = simulate(problem, runtime.default_plan(g).schedule)
    eager = helpers.train_eager(model, loss_fn, batch)
    for impl in ("inplace", "mask-inplace", "bitmask-inplace"):
        schedule = in_place_schedule(g, variants, impl)
        result = helpers.train_plan(model, loss_fn, batch, Plan(g.fingerprint, schedule), graph=g)
        assert_equal_step(eager, result)
        sim = simulate(problem, schedule)
        helpers.assert_peak_matches(result.peak, sim.peak_bytes)
        if impl == "inplace":    # the ReLU step holds one copy of the activation, not two
            step = next(i for i, s in enumerate(schedule) if s.get("impl") == impl)
            assert sim.timeline[step] == default.timeline[step] - g.values[x].bytes
            assert sim.peak_bytes <= default.peak_bytes
    # arena mode: the in-place copies get no address, every other copy is placed; the step trains like eager
    schedule = in_place_schedule(g, variants)
    sim = simulate(problem, schedule)
    addresses = greedy_addresses(problem, sim)
    assert addresses and not {(int(sim.copy_start[c]), int(sim.copy_value[c])) for c in np.flatnonzero(sim.in_place)} \
        & set(addresses)
    trained = copy.deepcopy(model)
    loss = runtime.load(Plan(g.fingerprint, schedule, addresses), trained, loss_fn, graph=g, arena=True)(*batch)
    assert torch.equal(loss, eager.loss)
    assert all(torch.equal(p.grad, eager.grads[k]) for k, p in trained.named_parameters())
    c = int(np.flatnonzero(sim.in_place)[0])                   # the BatchNorm output the ReLU overwrites
    with pytest.raises(PlanError, match="a copy that an in-place step overwrites or writes into"):
        Plan(g.fingerprint, schedule, {(int(sim.copy_start[c]), int(sim.copy_value[c])): 0}).validate(g, variants)
    # the output-activated BatchNorm backward reads the BatchNorm output, which the ReLU overwrote: refused
    schedule = [dict(s, impl="output") if "output" in variants.specs.get(s["compute"], {}) else s for s in schedule]
    with pytest.raises(PlanError, match=r"reads value %d .*but schedule\[\d+\] overwrote it in place" % x):
        Plan(g.fingerprint, schedule).validate(g, variants)
    with pytest.raises(InvalidSchedule, match=r"reads value %d, but schedule\[\d+\] ran node %d .* in place" % (x, relus[0])):
        simulate(problem, schedule)


def test_variant_value_ids_do_not_depend_on_the_rules_chosen():
    """A plan made under some rules names the variant values the executor's full set numbers alike."""
    g = small_cnn("mobilenet_v2")[3]
    full = graph_variants(g)
    for rules in (("bitmask",), ("output", "inplace"), ("mask", "bitmask")):
        some = graph_variants(g, rules)
        assert some.values == full.values
        offered = {spec.rule for specs in some.specs.values() for spec in specs.values()}
        assert offered and offered <= set(rules), rules
        for node, specs in some.specs.items():
            for name, spec in specs.items():
                assert full.specs[node][name] == spec
