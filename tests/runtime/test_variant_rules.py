"""MONeT's operator variants (runtime.variants.offered) on real models: each rule alone and all at once train like
eager PyTorch at the simulated peak, and so do `monet` plans at three budgets (one module: the models are
traced once); the split convolution backward; the arithmetic of each variant's code against ATen's own
backward."""

import pytest
import torch

from memplan import runtime
from memplan.runtime.tracing.fused_gelu import tanh_by_sigmoid
from memplan.runtime.format.plan import Plan
from memplan.runtime.variants.kernels import (batch_norm_backward_from_output, dense_order, layer_norm_backward_from_output,
                                     max_pool_backward_from_windows, pack_zero_bits, unpack_zero_bits,
                                     window_positions)
from memplan.runtime.variants.offered import RULES, graph_variants
from memplan.tasks.solve import solve
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import default_schedule, simulate
from memplan.tasks.solve.core.solution import SolveOptions, min_budget_lower_bound

aten = torch.ops.aten
# bit-identical to ATen (rules, and the variant names of rule `inplace`); the others within the validation tolerance
EXACT_RULES = {"mask", "bitmask", "compact", "inplace", "mask-inplace", "bitmask-inplace"}
EXPECTED = {"resnet18": {"mask", "bitmask", "output", "compact", "inplace", "native"},
            "mobilenet_v2": {"mask", "bitmask", "output", "native"}, "vgg11": {"mask", "bitmask", "compact", "inplace", "native"},
            "gpt2_sdpa": {"output", "math"}}


def variant_schedule(graph, variants, rules):
    """The default order, every node offering a variant of `rules` run as it; where a ReLU offers both
    `mask` and `bitmask`, every other ReLU (in forward order) takes `bitmask`, its backward the same; with
    rule `inplace`, a ReLU offering it runs in place (`mask-inplace` / `bitmask-inplace` with its mask)."""
    masks = sorted(spec.outputs[-1] for specs in variants.specs.values() for spec in specs.values()
                   if spec.rule == "bitmask" and spec.outputs[-1] >= variants.num_graph_values)
    packed = set(masks[1::2])
    steps = []
    for node in graph.nodes:
        specs = variants.specs.get(node.id, {})
        names = [name for name in specs if specs[name].rule in rules]
        if {"mask", "bitmask"} <= set(names):
            keep = "bitmask" if packed & {*specs["bitmask"].inputs, *specs["bitmask"].outputs} else "mask"
            names = [name for name in names if name not in {"mask", "bitmask"} - {keep}]
        if any(specs[name].rule == "inplace" for name in names):
            mask = [name for name in names if name in ("mask", "bitmask")]
            names = [f"{mask[0]}-inplace" if mask else "inplace"]
        assert len(names) <= 1, (node, names)
        steps.append({"compute": node.id, "impl": names[0]} if names else {"compute": node.id})
    # a ReLU runs in place only where no other step's variant reads its input (the `output` BatchNorm backward
    # reads the BatchNorm output, the ReLU's input): it keeps its mask variant, or the default
    reads = [set(variants.io(graph, s["compute"], s.get("impl"))[0]) for s in steps]
    for i, s in enumerate(steps):
        spec = variants.spec(s["compute"], s.get("impl"))
        if spec is not None and spec.overwrites and any(spec.overwrites[0][1] in r for j, r in enumerate(reads) if j != i):
            steps[i] = {"compute": s["compute"], "impl": s["impl"].removesuffix("-inplace")} \
                if s["impl"] != "inplace" else {"compute": s["compute"]}
    return steps


_EAGER: dict[str, object] = {}


def eager_step(helpers, name, model, loss_fn, batch):
    """One eager step of model `name`, run once per module (both model tests compare with it)."""
    if name not in _EAGER:
        _EAGER[name] = helpers.train_eager(model, loss_fn, batch)
    return _EAGER[name]


def equal_step(a, b):
    return torch.equal(a.loss, b.loss) and all(torch.equal(a.grads[k], b.grads[k]) for k in a.grads) and \
        all(torch.equal(a.buffers[k], b.buffers[k]) for k in a.buffers)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_rule_and_all_rules_train_like_eager_at_the_simulated_peak(captured, helpers, name):
    model, loss_fn, batch, g = captured(name)
    variants = graph_variants(g)
    offered = {s.rule for specs in variants.specs.values() for s in specs.values()}
    assert offered == EXPECTED[name]
    problem = Problem.from_graph(g, None, variants)
    eager = eager_step(helpers, name, model, loss_fn, batch)
    for rules in [*({r} for r in sorted(offered)), offered]:
        schedule = variant_schedule(g, variants, rules)
        result = helpers.train_plan(model, loss_fn, batch, Plan(g.fingerprint, schedule), graph=g)
        if rules <= EXACT_RULES:
            assert equal_step(eager, result), rules
        elif name == "mobilenet_v2":
            # output-activated BatchNorm sums in another order; through mobilenet_v2's depthwise weight
            # gradients one element of 864 (features.2.conv.1.0.weight) moves 2.3e-4 relative, 2e-5 absolute
            helpers.assert_same_step(eager, result, rtol=1e-3, atol=1e-4)
        else:
            helpers.assert_same_step(eager, result)
        helpers.assert_peak_matches(result.peak, simulate(problem, schedule).peak_bytes)


# budgets, as fractions of the span from the smallest budget any schedule could fit (the largest single step) to
# the eager-order peak (at these sizes parameters and their gradients are most of the peak), each below the
# eager peak and at or above what a cheap incumbent fits (`cheap_incumbent`), so the test does not depend on
# how far the MILP gets in its second: ap-greedy fits down to 0.7 (resnet18), 0.4 (mobilenet_v2), 0.6 (gpt2_sdpa)
# and nowhere on vgg11, whose exact-variant schedule fits 0.734
MONET_BUDGETS = {"resnet18": (0.9, 0.8, 0.7), "mobilenet_v2": (0.9, 0.75, 0.6), "vgg11": (0.9, 0.8, 0.74),
                 "gpt2_sdpa": (0.9, 0.75, 0.6)}


def cheap_incumbent(problem, budget):
    """The default order with the bit-packed ReLU mask and the compact max-pool wherever offered, when it fits
    `budget` (a schedule in MONeT's space); None leaves monet its own warm start (checkpoint-all, ap-greedy)."""
    schedule = [("compute", n, next((i for i in ("bitmask", "compact") if i in problem.impls(n)), "default"))
                for n in range(problem.num_nodes)]
    return schedule if simulate(problem, schedule).peak_bytes <= budget else None


@pytest.mark.parametrize("name", sorted(MONET_BUDGETS))
def test_monet_plans_at_three_budgets_train_like_eager_at_the_simulated_peak(captured, helpers, name):
    """The issue's done-criterion on real models: `monet` (warm-started, one second of MILP) plans every node's
    checkpointing and implementation jointly; each plan is below the eager peak, so it recomputes or runs
    variants, and trains like eager PyTorch (bit-exact when it takes only exact rules) at the simulated peak."""
    model, loss_fn, batch, g = captured(name)
    problem = Problem.from_graph(g, None, graph_variants(g))
    eager_peak = simulate(problem, default_schedule(problem)).peak_bytes
    lower = min_budget_lower_bound(problem)
    eager = eager_step(helpers, name, model, loss_fn, batch)
    trained = {}                                          # schedule -> measured step (a plan is run once)
    for fraction in MONET_BUDGETS[name]:
        budget = int(lower + fraction * (eager_peak - lower))
        options = SolveOptions(time_limit=1.0, portfolio=False, mip_start=cheap_incumbent(problem, budget))
        solution = solve(problem, "monet", budget, options)
        assert solution.feasible, (fraction, solution.status, solution.message)
        plan = solution.to_plan(problem)
        impls = plan.impls()                               # variant names are their rules' names
        assert impls or solution.objective > problem.cost.sum(), fraction    # below the eager peak: not the default
        key = repr(plan.schedule)
        if key not in trained:
            trained[key] = helpers.train_plan(model, loss_fn, batch, plan, graph=g)
        result = trained[key]
        if impls <= EXACT_RULES:
            assert equal_step(eager, result), (fraction, impls)
        elif name == "mobilenet_v2":                      # see test_each_rule_and_all_rules_train_like_eager...
            helpers.assert_same_step(eager, result, rtol=1e-3, atol=1e-4)
        else:
            helpers.assert_same_step(eager, result)
        assert solution.predicted_peak_bytes == simulate(problem, plan.schedule).peak_bytes <= budget < eager_peak
        helpers.assert_peak_matches(result.peak, solution.predicted_peak_bytes)


def test_convolution_backward_is_split_so_the_input_gradient_does_not_read_the_forward_input(captured):
    _, _, _, g = captured("resnet18")
    weight_grads = [n for n in g.nodes if n.targets[0] == "aten.convolution_backward.default"]
    input_grads = [n for n in g.nodes if n.phase == "backward" and n.targets[0] == "aten.convolution.default"]
    assert len(input_grads) == 19 and len(weight_grads) == 20       # the stem conv has no input gradient
    forward_inputs = {n.inputs[0] for n in g.nodes if n.phase == "forward" and n.targets[0] == "aten.convolution.default"}
    for n in input_grads:
        assert not forward_inputs & set(n.inputs)
        partner = g.nodes[n.id - 1]                                  # the weight gradient comes first
        assert partner.targets[0] == "aten.convolution_backward.default" and partner.inputs[1] in forward_inputs
        assert n.inputs[0] == partner.inputs[0]                     # both read the same output gradient


def test_normalization_backward_from_output_matches_aten_with_any_affine_parameters():
    torch.manual_seed(0)
    x = torch.randn(4, 6, 5, 5, dtype=torch.float64)
    w, b = torch.randn(6, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    y, mean, invstd, _, _ = aten._native_batch_norm_legit_functional(x, w, b, torch.zeros(6, dtype=torch.float64),
                                                                     torch.ones(6, dtype=torch.float64), True, 0.1, 1e-5)
    grad = torch.randn_like(y)
    want = aten.native_batch_norm_backward(grad, x, w, None, None, mean, invstd, True, 1e-5, [True, True, True])
    got = batch_norm_backward_from_output(grad, y, w, b, invstd, [True, True, True])
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-10)
    x = torch.randn(3, 7, 16, dtype=torch.float64)
    w, b = torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    y, mean, rstd = aten.native_layer_norm(x, [16], w, b, 1e-5)
    grad = torch.randn_like(y)
    want = aten.native_layer_norm_backward(grad, x, [16], mean, rstd, w, b, [True, True, True])
    got = layer_norm_backward_from_output(grad, y, [16], rstd, w, b, [True, True, True])
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-10)
    with pytest.raises(RuntimeError, match="nonzero"):
        layer_norm_backward_from_output(grad, y, [16], rstd, w * (torch.arange(16) % 2), b, [True, True, True])


@pytest.mark.parametrize("kernel, stride, padding, dilation", [(3, 2, 1, 1), (2, 2, 0, 1), (3, 1, 1, 2)])
def test_max_pool_window_positions_rebuild_atens_indices_and_gradient(kernel, stride, padding, dilation):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 11, 9)
    k, s, p, d = [kernel] * 2, [stride] * 2, [padding] * 2, [dilation] * 2
    out, indices = aten.max_pool2d_with_indices(x, k, s, p, d, False)
    windows = window_positions(indices.clone(), x.shape[-1], k, s, p, d)
    assert windows.dtype == torch.uint8 and int(windows.max()) < kernel * kernel
    grad = torch.randn_like(out)
    want = aten.max_pool2d_with_indices_backward(grad, x, k, s, p, d, False, indices)
    assert torch.equal(max_pool_backward_from_windows(grad, windows, list(x.shape), k, s, p, d, False), want)


def test_registry_lists_every_rule_under_its_own_name():
    assert list(RULES) == ["mask", "output", "compact", "math", "bitmask", "inplace", "sigmoid",
                           "native"]   # value-id order
    assert all(rule.name == name for name, rule in RULES.items())


@pytest.mark.parametrize("numel", [0, 1, 7, 8, 9, 23, 64, 1001])
def test_bit_packed_mask_holds_one_bit_per_element_at_odd_sizes(numel):
    torch.manual_seed(numel)
    x = torch.randn(numel)
    x[::3] = 0.0                                          # ties: x <= 0 must hold at exactly 0
    packed = pack_zero_bits(x, 0, None, [0])
    assert packed.dtype == torch.uint8 and packed.shape == ((numel + 7) // 8,)
    mask = (x <= 0).tolist()
    for j in range(numel):                                # element j is bit j % 8 of byte j // 8
        assert (int(packed[j // 8]) >> (j % 8)) & 1 == mask[j], j
    if numel % 8:
        assert int(packed[-1]) >> (numel % 8) == 0       # the padding bits are zero
    assert torch.equal(unpack_zero_bits(packed, [numel], [1], [0]), x <= 0)
    clipped = pack_zero_bits(x, -0.5, 0.5, [0])
    assert torch.equal(unpack_zero_bits(clipped, [numel], [1], [0]), (x <= -0.5) | (x >= 0.5))


def test_bit_packed_mask_follows_memory_order_and_gives_atens_gradient():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 4, 7).contiguous(memory_format=torch.channels_last)
    x[0, 0] = float("nan")
    order = dense_order(list(x.shape), list(x.stride()))
    assert order == [0, 2, 3, 1] and dense_order([4, 4], [8, 1]) is None and dense_order([3, 4], [1, 3]) == [1, 0]
    mask = unpack_zero_bits(pack_zero_bits(x, 0, None, order), list(x.shape), list(x.stride()), order)
    assert mask.stride() == x.stride() and torch.equal(mask, x <= 0)
    grad = torch.randn_like(x)
    assert torch.equal(grad.masked_fill(mask, 0.0), aten.threshold_backward(grad, torch.relu(x), 0))


def test_attention_math_variant_pairs_the_probabilities_with_the_backward(captured):
    _, _, _, g = captured("gpt2_sdpa")
    variants = graph_variants(g)
    forward = [n for n, s in variants.specs.items() if "math" in s and g.nodes[n].phase == "forward"]
    assert len(forward) == 2
    for n in forward:
        spec = variants.specs[n]["math"]
        probs = variants.value(g, spec.outputs[-1])
        assert probs.shape == (2, 2, 32, 32) and probs.bytes == 2 * 2 * 32 * 32 * 4
        assert g.nodes[n].outputs[1] not in spec.outputs                # no logsumexp
        backward = [m for m, s in variants.specs.items() if "math" in s and probs.id in s["math"].inputs]
        assert len(backward) == 1 and g.nodes[n].outputs[1] not in variants.specs[backward[0]]["math"].inputs


def test_tanh_by_its_sigmoid_identity_trains_within_tolerance_at_the_simulated_peak(helpers):
    """Rule `sigmoid` on a plain `aten.tanh`: the variant's value is within 2.5e-7 of ATen's tanh (exact at 0 and
    +-inf, NaN kept), and a plan running it trains like eager within the tolerance, not bit for bit (the variant
    ran), at the simulated peak."""
    torch.manual_seed(0)
    z = torch.cat([torch.randn(10_000) * 4, torch.tensor([0.0, float("inf"), float("-inf"), float("nan")])])
    got, want = tanh_by_sigmoid(z), torch.tanh(z)
    assert not torch.equal(got[:-1], want[:-1]) and float((got - want)[:-1].abs().max()) <= 2.5e-7
    assert got[-4:-1].tolist() == [0.0, 1.0, -1.0] and torch.isnan(got[-1])

    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).to(helpers.device)
    loss_fn = lambda m, x, y: torch.nn.functional.cross_entropy(m(x), y)  # noqa: E731
    batch = (torch.randn(6, 8).to(helpers.device), torch.randint(0, 4, (6,)).to(helpers.device))
    g = runtime.capture(model, loss_fn, batch)
    variants = graph_variants(g)
    tanh = [n.id for n in g.nodes if n.targets[0] == "aten.tanh.default"]
    assert len(tanh) == 1 and {n: list(s) for n, s in variants.specs.items()} == {tanh[0]: ["sigmoid"]}
    schedule = [{"compute": n.id, "impl": "sigmoid"} if n.id in tanh else {"compute": n.id} for n in g.nodes]
    eager = helpers.train_eager(model, loss_fn, batch)
    planned = helpers.train_plan(model, loss_fn, batch, Plan(g.fingerprint, schedule), graph=g)
    helpers.assert_same_step(eager, planned)
    assert not equal_step(eager, planned)
    helpers.assert_peak_matches(planned.peak, simulate(Problem.from_graph(g, None, variants), schedule).peak_bytes)
