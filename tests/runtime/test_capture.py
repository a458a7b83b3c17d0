"""capture: folding into operator nodes, values, kinds, phases, outputs, determinism, node_function."""

import copy
import math
import os
import subprocess
import sys

import pytest
import torch
from torch import fx, nn

from memplan import runtime
import memplan.runtime.tracing.capture as capture_module
from memplan.runtime.tracing import fused_loss
from memplan.runtime.tracing.capture import CaptureError
from memplan.runtime.execute.executor import replayed_random_nodes
from memplan.runtime.format.graph import OpGraph
from memplan.runtime.measure.meter import PeakMeter
from memplan.runtime.policy.apply import capture_eager

VIEW_TARGETS = {"aten.t.default", "aten.view.default", "aten.alias.default", "aten._unsafe_view.default",
                "aten.expand.default", "aten.permute.default", "aten.transpose.int", "aten.slice.Tensor"}


def test_views_and_getitems_are_folded_into_allocating_nodes(captured):
    _, _, _, g = captured("mlp")
    assert len(g.nodes) < g.meta["aten_call_nodes"]
    for node in g.nodes:
        assert node.targets[0] not in VIEW_TARGETS, node
        assert node.outputs, node
    folded = [t for node in g.nodes for t in node.targets[1:]]
    assert "aten.t.default" in folded
    assert {"aten.alias.default", "aten.detach.default"} & set(folded)   # saved-tensor chains: torch 2.14 / 2.11


def test_values_have_dtype_aware_bytes_and_kinds(captured):
    model, _, batch, g = captured("mlp")
    for v in g.values:
        itemsize = torch.empty((), dtype=getattr(torch, v.dtype)).element_size()
        scratch = 0
        if v.name == "linear_cross_entropy_default.2":          # the fused loss gradient shares its storage
            rows, classes = v.shape                             # with one block of scratch rows, 512-aligned
            scratch = math.ceil(fused_loss.block_rows(rows, classes * itemsize) * classes * itemsize / 512) * 512
        assert v.bytes == math.prod(v.shape) * itemsize + scratch, v
    kinds = {v.name: v.kind for v in g.values if v.producer is None}
    assert kinds == {**{k: "param" for k, _ in model.named_parameters()},
                     **{k: "buffer" for k, _ in model.named_buffers()}, "input0": "input", "input1": "input"}
    mask = [v for v in g.values if v.dtype == "bool"]
    assert len(mask) == 1 and mask[0].bytes == 6 * 16          # the dropout mask: one byte per element
    assert g.constant_bytes == sum(t.numel() * t.element_size()
                                   for t in [*model.parameters(), *model.buffers(), *batch])


def test_outputs_are_loss_then_gradients_then_buffer_updates(captured):
    model, _, _, g = captured("mlp")
    params, buffers = list(model.parameters()), list(model.buffers())
    loss, grads, updates = g.outputs[0], g.outputs[1:1 + len(params)], g.outputs[1 + len(params):]
    assert g.values[loss].shape == () and g.values[loss].kind == "output"
    assert [g.values[v].bytes for v in grads] == [p.numel() * 4 for p in params]
    assert all(g.values[v].kind == "gradient" for v in grads)
    assert [g.values[v].bytes for v in updates] == [b.numel() * b.element_size() for b in buffers]
    assert all(g.values[v].kind == "output" for v in updates)


def test_phases_split_forward_loss_backward(captured):
    model, _, _, g = captured("mlp")
    n_params = len(list(model.parameters()))
    phases = [n.phase for n in g.nodes]
    assert phases == sorted(phases, key=["forward", "loss", "backward"].index)  # contiguous, in order
    loss_targets = {t for n in g.nodes if n.phase == "loss" for t in n.targets}
    assert "memplan.linear_cross_entropy.default" in loss_targets      # the head's product, then the loss
    assert not any("addmm" in t for t in loss_targets)
    assert g.nodes[g.values[g.outputs[0]].producer].phase == "loss"
    assert all(g.nodes[g.values[v].producer].phase == "backward" for v in g.outputs[1:1 + n_params])
    assert all(g.nodes[g.values[v].producer].phase == "forward" for v in g.outputs[1 + n_params:])


def test_capture_is_deterministic_and_leaves_the_model_alone(captured):
    model, loss_fn, batch, g = captured("mlp")
    state = copy.deepcopy(model.state_dict())
    rng = torch.get_rng_state()
    again = runtime.capture(model, loss_fn, batch)
    assert again.to_json() == g.to_json()
    assert torch.equal(rng, torch.get_rng_state())
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k


def test_capture_allocates_nothing_so_a_step_larger_than_the_device_is_captured(captured):
    """Capture traces on fake tensors: with a rewrite selection (a plan's, as `runtime.load` captures) or
    `verify=False` it allocates under a twentieth of what eager's step allocates (the allocator's peak), and
    captures the same graph; so does the policy form's capture, whose eager step that labels the backward's
    autograd Nodes runs on fake tensors too. (`aot_export_module` traces the joint graph again on the tensors it
    is given, and on real ones that ran the whole step: eager's memory, so a step that needed a plan to fit its
    GPU could not be captured there. The default capture checks its rewrites by running the step once on real
    values: test_capture_encoders.py.)"""
    model, loss_fn, batch, graph = captured("gpt2")
    with PeakMeter("cpu", allocator=True) as eager:
        loss_fn(model, *batch).backward()
    model.zero_grad(set_to_none=True)
    with PeakMeter("cpu", allocator=True) as tracing:
        again = runtime.capture(model, loss_fn, batch, rewrites=graph.meta["rewrites"]["applied"])
    assert again.fingerprint == graph.fingerprint
    assert tracing.peak_bytes < eager.peak_bytes / 20
    with PeakMeter("cpu", allocator=True) as tracing:
        runtime.capture(model, loss_fn, batch, verify=False)
    assert tracing.peak_bytes < eager.peak_bytes / 20
    with PeakMeter("cpu", allocator=True) as tracing:       # the policy form's capture labels autograd's Nodes
        eager_graph = capture_eager(model, loss_fn, batch)   # on a fake step too
    labels = eager_graph.meta["autograd_nodes"]
    backward = [n.id for n in eager_graph.nodes if n.phase == "backward"]
    assert sum(labels[n] is not None for n in backward) > len(backward) / 2
    assert tracing.peak_bytes < eager.peak_bytes / 20


@pytest.mark.parametrize("change", ["batch size", "dtype", "eval mode"])
def test_fingerprint_changes_with_shape_dtype_and_mode(captured, change):
    model, loss_fn, (x, y), g = captured("mlp")
    model = copy.deepcopy(model)
    if change == "batch size":
        x, y = x[:4], y[:4]
    elif change == "dtype":
        model, x = model.double(), x.double()
    else:
        model.eval()
    assert runtime.capture(model, loss_fn, (x, y)).fingerprint != g.fingerprint


def test_loaded_graph_has_no_program(captured, tmp_path):
    _, _, _, g = captured("mlp")
    g.save(tmp_path / "g.json")
    loaded = OpGraph.load(tmp_path / "g.json")
    assert loaded.fingerprint == g.fingerprint
    with pytest.raises(CaptureError, match="no captured program"):
        runtime.node_function(loaded, 0)


def test_bad_batch_and_loss_are_refused(captured):
    model, loss_fn, (x, y), _ = captured("mlp")
    with pytest.raises(CaptureError, match=r"batch\[1\] is a int"):
        runtime.capture(model, loss_fn, (x, 3))
    with pytest.raises(CaptureError, match="scalar tensor"):
        runtime.capture(model, lambda m, x: m(x), (x,))


class _Branching(nn.Module):
    """A branch on a tensor's value (`if`), or an op whose output shape depends on the data."""

    def __init__(self, kind: str):
        super().__init__()
        self.lin, self.kind = nn.Linear(4, 4), kind

    def forward(self, x):
        h = self.lin(x)
        if self.kind == "branch":
            if h.sum() > 0:                                  # reads a value: line named in the error
                h = h * 2
            return h
        return h[h > 0]                                      # a shape that depends on the data


@pytest.mark.parametrize("kind, line", [("branch", "if h.sum() > 0"), ("shape", "return h[h > 0]")])
def test_a_step_that_depends_on_tensor_values_is_refused_naming_the_line(kind, line):
    import inspect

    source, first = inspect.getsourcelines(_Branching.forward)
    lineno = first + next(i for i, text in enumerate(source) if line in text)
    with pytest.raises(CaptureError, match=rf"depends on a tensor's values at .*test_capture\.py:{lineno} in forward"):
        runtime.capture(_Branching(kind), lambda m, x: m(x).sum(), (torch.randn(2, 4),))


@pytest.mark.parametrize("mask", [False, True])
def test_a_transformers_lm_run_without_cache_captures_with_or_without_a_mask(mask):
    """transformers' checks that read a tensor (the packed-sequence check of the position ids without a mask;
    whether an all-ones mask can be skipped) take their traced path while capture traces: the graph builds the
    mask, for every batch, and trains like eager. They stopped capture before (issue #53)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8, use_cache=False,
                        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config).train()
    ids = torch.randint(0, 32, (2, 8))
    batch = (ids, torch.ones(2, 8, dtype=torch.long)) if mask else (ids,)
    loss_fn = lambda m, ids, *mask: m(ids, attention_mask=mask[0] if mask else None, labels=ids).loss  # noqa: E731
    graph = runtime.capture(model, loss_fn, batch)
    eager = copy.deepcopy(model)
    loss = loss_fn(eager, *batch)
    loss.backward()
    planned = copy.deepcopy(model)
    torch.testing.assert_close(runtime.load(runtime.default_plan(graph), planned, loss_fn, graph=graph)(*batch),
                               loss.detach())
    for (k, a), b in zip(eager.named_parameters(), planned.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=lambda m: f"grad {k}: {m}")


class _Recorder(fx.Interpreter):
    """Runs the joint graph keeping every value, and the RNG state before each random op."""

    def __init__(self, gm):
        super().__init__(gm, garbage_collect_values=False)
        self.rng_before = {}

    def run_node(self, n):
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) \
                and torch.Tag.nondeterministic_seeded in n.target.tags:
            self.rng_before[n] = torch.get_rng_state()
        return super().run_node(n)


@pytest.mark.parametrize("name", ["mlp", "gpt2"])
def test_node_function_runs_each_node_alone(captured, name):
    model, _, batch, g = captured(name)
    program = g.program
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    args = [params[k] for k in program.params] + [buffers[k] for k in program.buffers] + list(batch)
    rec = _Recorder(program.gm)
    with torch.no_grad():
        rec.run(*args)

    def tensor(v):
        where = program.primary[v]
        return rec.env[where] if isinstance(where, fx.Node) else rec.env[where[0]][where[1]]

    with torch.no_grad():
        for node in g.nodes:
            f = runtime.node_function(g, node.id)
            random = [m for m in program.groups[node.id] if m in rec.rng_before]
            if random:
                torch.set_rng_state(rec.rng_before[random[0]])
            outs = f(*[tensor(v) for v in node.inputs])
            assert isinstance(outs, tuple) and len(outs) == len(node.outputs), node
            for v, out in zip(node.outputs, outs):
                assert tuple(out.shape) == g.values[v].shape and str(out.dtype) == f"torch.{g.values[v].dtype}"
                torch.testing.assert_close(out, tensor(v), rtol=0, atol=0, msg=lambda m: f"{node.name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("p", [0.1, 1 / 3, 0.5, 0.9])
def test_split_dropout_draws_and_computes_what_native_dropout_does(dtype, p):
    x = torch.randn(3, 1031).to(dtype)
    torch.manual_seed(7)
    out, mask = torch.ops.aten.native_dropout(x, p, True)
    after = torch.get_rng_state()
    torch.manual_seed(7)
    split_mask = torch.ops.memplan.dropout_mask(x, p)
    assert torch.equal(torch.get_rng_state(), after) and torch.equal(split_mask, mask)
    assert torch.equal(torch.ops.memplan.dropout_apply(x, split_mask, p), out)
    assert torch.get_rng_state().equal(after)                  # the product draws nothing


def test_recomputed_dropout_output_reuses_its_mask_without_drawing(captured, helpers):
    """Capture splits each training dropout into its mask's draw (random) and its product (not): a plan
    that recomputes GPT-2's dropout outputs from the kept masks replays no generator and trains bit for bit
    like eager."""
    model, loss_fn, batch, g = captured("gpt2")
    assert not any(t == "aten.native_dropout.default" for n in g.nodes for t in n.targets)
    draws = {n.id for n in g.nodes if n.targets[0] == "memplan.dropout_mask.default"}
    products = {n.id for n in g.nodes if n.targets[0] == "memplan.dropout_apply.default"}
    assert draws and len(products) == len(draws) and set(g.program.random_devices) == draws
    assert all(len(draws & {g.values[v].producer for v in g.nodes[n].inputs}) == 1 for n in products)
    plan = runtime.Plan(g.fingerprint, helpers.recompute_schedule(g, products))
    recomputed = {n for n in products if plan.compute_steps().count(n) == 2}
    assert recomputed and not replayed_random_nodes(plan, g.program)
    result = helpers.train_plan(model, loss_fn, batch, plan, graph=g)
    reference = helpers.train_eager(model, loss_fn, batch)
    assert torch.equal(reference.loss, result.loss) and torch.equal(reference.rng, result.rng)
    assert all(torch.equal(reference.grads[k], result.grads[k]) for k in reference.grads)
    helpers.assert_peak_matches(result.peak, helpers.simulated_peak(g, plan.schedule))


def test_attention_without_dropout_draws_nothing(captured):
    """Fused attention is tagged random for its dropout; at dropout_p 0 it draws nothing, so a plan may
    recompute it without replaying the generator (and a CUDA graph can hold such a plan)."""
    _, _, _, g = captured("gpt2_sdpa")
    attention = [n for n in g.nodes if n.phase == "forward" and "scaled_dot_product" in n.targets[0]]
    dropout = [n.id for n in g.nodes if n.targets[0] == "memplan.dropout_mask.default"]
    assert attention and dropout
    packet, overload = attention[0].targets[0].removeprefix("aten.").split(".")
    assert torch.Tag.nondeterministic_seeded in getattr(getattr(torch.ops.aten, packet), overload).tags
    random = set(g.program.random_devices)
    assert not random & {n.id for n in attention} and set(dropout) <= random


def test_tied_weights_get_one_gradient_output_per_name(captured):
    model, _, _, g = captured("gpt2")
    names = [k for k, _ in model.named_parameters(remove_duplicate=False)]
    assert "lm_head.weight" in names and len(names) == len(list(model.parameters())) + 1
    grads = [v for v in g.outputs if g.values[v].kind == "gradient"]
    assert len(grads) == len(names)


def test_fingerprint_is_the_same_in_another_process(captured):
    _, _, _, g = captured("mlp")
    conftest = os.path.join(os.path.dirname(__file__), "conftest.py")
    code = ("import importlib.util, runtime\n"
            f"spec = importlib.util.spec_from_file_location('helpers', {conftest!r})\n"
            "helpers = importlib.util.module_from_spec(spec); spec.loader.exec_module(helpers)\n"
            "print(runtime.capture(*helpers.build('mlp')).fingerprint)\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                         env={**os.environ, "PYTHONHASHSEED": "123"})
    assert out.stdout.strip().splitlines()[-1] == g.fingerprint


class _DenseStack(torch.nn.Module):
    """Each layer reads the concatenation of every earlier output, as torchvision's dense blocks do."""

    def __init__(self, width=3, layers=3):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width * (i + 1), width) for i in range(layers))

    def forward(self, x):
        features = [x]
        for layer in self.layers:
            features.append(torch.relu(layer(torch.cat(features, 1))))
        return torch.cat(features, 1)


def test_concatenations_of_growing_lists_are_chained(helpers):
    torch.manual_seed(0)
    model, batch = _DenseStack(), (torch.randn(4, 3), torch.randint(0, 12, (4,)))
    loss_fn = helpers.build("mlp")[1]
    g = runtime.capture(model, loss_fn, batch)
    cats = [n for n in g.nodes if n.targets[0] == "aten.cat.default" and n.phase != "backward"]
    assert len(cats) == 3         # one per layer and the block output, but the first layer's: `cat([x])` is x
    for earlier, cat in zip(cats, cats[1:]):                # each reads the previous one and the newest piece
        assert len(cat.inputs) == 2 and earlier.outputs[0] in cat.inputs, cat
        newest = g.values[[v for v in cat.inputs if v != earlier.outputs[0]][0]]
        assert newest.shape == (4, 3) and g.nodes[newest.producer].targets[0] == "aten.relu.default"
    plan = runtime.default_plan(g)
    helpers.assert_same_step(helpers.train_eager(model, loss_fn, batch),
                             helpers.train_plan(model, loss_fn, batch, plan, graph=g))


class _Pointwise(torch.nn.Module):
    """A 3x3 convolution, then pointwise ones (one strided): only the stride-1 pointwise input gradients
    are matrix products."""

    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.expand, self.project = torch.nn.Conv2d(8, 16, 1), torch.nn.Conv2d(16, 8, 1, bias=False)
        self.down = torch.nn.Conv2d(8, 4, 1, stride=2)

    def forward(self, x):
        return self.down(self.project(torch.relu(self.expand(torch.relu(self.stem(x)))))).mean((2, 3))


@pytest.mark.parametrize("dtype, threads, products", [(torch.float32, 1, 2), (torch.float64, 2, 2),
                                                      (torch.float32, 2, 0)])
def test_pointwise_input_gradients_are_matrix_products_where_aten_uses_its_gemm_path(helpers, dtype, threads,
                                                                                      products):
    torch.manual_seed(0)
    model = _Pointwise().to(dtype)
    batch = (torch.randn(3, 3, 9, 9, dtype=dtype), torch.randint(0, 4, (3,)))
    loss_fn = lambda m, x, y: torch.nn.functional.cross_entropy(m(x), y)  # noqa: E731
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = runtime.capture(model, loss_fn, batch)
        eager = helpers.train_eager(model, loss_fn, batch)
        planned = helpers.train_plan(model, loss_fn, batch, runtime.default_plan(g), graph=g)
    finally:
        torch.set_num_threads(before)
    bmm = [n for n in g.nodes if n.targets[0] == "aten.bmm.default"]
    transposed = [n for n in g.nodes if n.phase == "backward" and n.targets[0] == "aten.convolution.default"]
    assert len(bmm) == products and len(transposed) == 3 - products   # the stem has no input gradient
    forward_inputs = {n.inputs[0] for n in g.nodes if n.phase == "forward" and n.targets[0] == "aten.convolution.default"}
    assert not any(forward_inputs & set(n.inputs) for n in bmm)    # the forward input can go after the weight gradient
    assert torch.equal(eager.loss, planned.loss)
    assert all(torch.equal(eager.grads[k], planned.grads[k]) for k in eager.grads)


class _Depthwise(torch.nn.Module):
    """A 3x3 convolution, a depthwise one (8 groups) and a 2x2 one: the last two have input gradients."""

    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.depthwise = torch.nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.mix = torch.nn.Conv2d(8, 4, 2)

    def forward(self, x):
        return self.mix(torch.relu(self.depthwise(torch.relu(self.stem(x))))).mean((2, 3))


@pytest.mark.parametrize("on_cpu", [True, False])
def test_grouped_convolution_backwards_split_on_cpu_graphs_only(helpers, monkeypatch, on_cpu):
    """A GPU graph (`_cpu_graph` False) keeps the depthwise backward joint, where CUDA rounds its split
    halves differently; the ungrouped ones split everywhere. Either graph trains like eager, bit for bit.
    The split graph runs on the CPU, the joint one on $MEMPLAN_TEST_DEVICE."""
    device = torch.device("cpu") if on_cpu else helpers.device
    torch.manual_seed(0)
    model = _Depthwise().to(device)
    batch = (torch.randn(3, 3, 9, 9, device=device), torch.randint(0, 4, (3,), device=device))
    loss_fn = lambda m, x, y: torch.nn.functional.cross_entropy(m(x), y)  # noqa: E731
    monkeypatch.setattr(capture_module, "_cpu_graph", lambda model, batch: on_cpu)
    g = runtime.capture(model, loss_fn, batch)
    backward = [n for n in g.nodes if n.phase == "backward"]
    transposed = [n for n in backward if n.targets[0] == "aten.convolution.default"]
    joint = [n for n in backward if n.targets[0] == "aten.convolution_backward.default" and len(n.outputs) > 2]
    assert (len(transposed), len(joint)) == ((2, 0) if on_cpu else (1, 1))    # the stem has no input gradient
    helpers.train_like_eager_bitwise(model, loss_fn, batch, g)
