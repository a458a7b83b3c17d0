"""The written-out tanh GELU (transformers' `gelu_new`) is fused at capture into three bit-identical ops
whose backward keeps two of the four tensors it kept (runtime/tracing/fused_gelu.py)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from memplan import runtime
import memplan.runtime.tracing.capture as capture_module
from memplan.runtime.tracing import fused_gelu
from memplan.runtime.measure.meter import PeakMeter
from memplan.runtime.format.plan import Plan
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import default_schedule, simulate

C = math.sqrt(2.0 / math.pi)
CONSTANTS = (0.5, 3.0, 0.044715, C, 1.0)
FUSED = ("memplan.gelu_tanh_inner.default", "memplan.gelu_tanh_outer.default", "memplan.gelu_tanh_backward.default")


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """transformers' `NewGELUActivation`, as written there."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def _eager(x, grad):
    x = x.detach().requires_grad_()
    y = gelu_new(x)
    y.backward(grad)
    return y.detach(), x.grad


def _peak(graph) -> int:
    problem = Problem.from_graph(graph)
    return simulate(problem, default_schedule(problem)).peak_bytes


def _saved_bytes(graph) -> int:
    """Bytes of the forward's values that the backward reads."""
    read_in_backward = {v for n in graph.nodes if n.phase == "backward" for v in n.inputs}
    return sum(graph.values[v].bytes for n in graph.nodes if n.phase != "backward" for v in n.outputs
               if v in read_in_backward)


def _targets(graph) -> list[str]:
    return [t for n in graph.nodes for t in n.targets]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("shape", [(4, 64, 96), (7, 13), (3, 100, 37), (1,)])
@pytest.mark.parametrize("blocks", ["default", "many"])
def test_ops_equal_autograd_of_the_written_out_gelu_bit_for_bit(helpers, monkeypatch, threads, dtype, shape, blocks):
    """Output and input gradient equal eager autograd's bits, over odd sizes whose vector loops end in a
    scalar tail, in one block or in many (256-element blocks), on one thread or two."""
    if blocks == "many":
        monkeypatch.setattr(fused_gelu, "BLOCKS", 10 ** 6)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        x, grad = (t.to(helpers.device) for t in (torch.randn(shape, dtype=dtype) * 3, torch.randn(shape, dtype=dtype)))
        y_eager, grad_eager = _eager(x, grad)
        t = torch.ops.memplan.gelu_tanh_inner(x, 3.0, 0.044715, C)
        assert torch.equal(t, torch.tanh(C * (x + 0.044715 * torch.pow(x, 3.0))))
        assert torch.equal(torch.ops.memplan.gelu_tanh_outer(x, t, 0.5, 1.0), y_eager)
        assert torch.equal(torch.ops.memplan.gelu_tanh_backward(grad, x, t, *CONSTANTS), grad_eager)
    finally:
        torch.set_num_threads(before)


def test_ops_allocate_only_their_results():
    """The scratch blocks lead the storage of a result (the output's: one block; the gradient's: two), so
    the meter and the planners, which count results, see every byte; the tanh takes exactly its bytes."""
    n = 4 * 64 * 1024
    x, grad = torch.randn(4, 64, 1024), torch.randn(4, 64, 1024)
    block = fused_gelu.block_elements(n) * 4
    assert block == n * 4 // fused_gelu.BLOCKS
    with PeakMeter("cpu") as meter:
        t = torch.ops.memplan.gelu_tanh_inner(x, 3.0, 0.044715, C)
    assert meter.peak_bytes == t.untyped_storage().nbytes() == n * 4
    with PeakMeter("cpu") as meter:
        y = torch.ops.memplan.gelu_tanh_outer(x, t, 0.5, 1.0)
    assert meter.peak_bytes == y.untyped_storage().nbytes() == n * 4 + block
    with PeakMeter("cpu") as meter:
        gx = torch.ops.memplan.gelu_tanh_backward(grad, x, t, *CONSTANTS)
    assert meter.peak_bytes == gx.untyped_storage().nbytes() == n * 4 + 2 * block


def _gpt2(device):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32, bos_token_id=0,
                        eos_token_id=0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config).train().to(device), (torch.randint(0, 128, (2, 32)).to(device),)


def lm_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def test_gpt2_gelu_is_fused_and_trains_like_eager_with_and_without_recomputation(helpers, monkeypatch):
    """Each of GPT-2's two layers gets two forward ops and one backward op in place of 19 ATen ops (8 +
    11); the values the backward reads shrink by two x-sized tensors a layer (less the output's scratch
    block); the step's peak falls, and the step trains bit-identically to eager with the predicted peak,
    also when a plan recomputes the fused forward ops in the backward."""
    model, batch = _gpt2(helpers.device)
    g = runtime.capture(model, lm_loss, batch)
    as_traced = runtime.capture(model, lm_loss, batch, rewrites={**g.meta["rewrites"]["applied"], "fuse_tanh_gelu": []})

    targets = _targets(g)
    if helpers.device.type != "cpu":                  # fused in CPU graphs only (runtime/tracing/capture.py)
        assert not set(FUSED) & set(targets) and len(g.nodes) == len(as_traced.nodes)
        return
    assert [targets.count(t) for t in FUSED] == [2, 2, 2]
    assert "aten.tanh_backward.default" not in targets and "aten.tanh.default" not in targets
    assert len(as_traced.nodes) - len(g.nodes) == 2 * (8 + 11 - 3)
    x_bytes = 2 * 32 * 4 * 64 * 4                              # the MLP's hidden layer: tokens x 4 * width, fp32
    block = fused_gelu.block_elements(x_bytes // 4) * 4
    assert _saved_bytes(as_traced) - _saved_bytes(g) == 2 * (2 * x_bytes - block)
    assert _peak(g) < _peak(as_traced)

    eager = helpers.train_eager(model, lm_loss, batch)
    fused_forward = [n.id for n in g.nodes if n.targets[0] in FUSED[:2]]
    for plan in (runtime.default_plan(g), Plan(g.fingerprint, helpers.recompute_schedule(g, fused_forward))):
        planned = helpers.train_plan(model, lm_loss, batch, plan, graph=g)
        assert torch.equal(eager.loss, planned.loss)
        assert all(torch.equal(eager.grads[k], planned.grads[k]) for k in eager.grads)
        helpers.assert_peak_matches(planned.peak, helpers.simulated_peak(g, plan.schedule))
    assert all(plan.compute_steps().count(n) == 2 for n in fused_forward)      # the last plan recomputes them


class GeluMLP(nn.Module):
    """Linear, the written-out GELU, linear. With `leak`, one of the GELU's intermediates is also read by
    the output through a comparison (no gradient flows back, so the GELU's backward is as autograd writes
    it) and must stay a value of its own. "reordered" computes the tanh before `0.5 x`: autograd then sums
    x's gradient in another order (other bits), which the fused backward does not compute."""

    def __init__(self, variant: str | None = None):
        super().__init__()
        self.up, self.down, self.variant = nn.Linear(8, 32), nn.Linear(32, 8), variant

    def forward(self, x):
        h = self.up(x)
        if self.variant is None:
            return self.down(gelu_new(h))
        if self.variant == "reordered":
            t = torch.tanh(C * (h + 0.044715 * torch.pow(h, 3.0)))
            return self.down(0.5 * h * (1.0 + t))
        half = 0.5 * h
        t = torch.tanh(C * (h + 0.044715 * torch.pow(h, 3.0)))
        y = half * (1.0 + t)
        return self.down(y) + ((t if self.variant == "tanh read" else half)[..., :8] > 0).float()


@pytest.mark.parametrize("variant, fused", [(None, True), ("tanh read", False), ("half read", False),
                                            ("reordered", False)])
def test_gelu_is_fused_only_where_its_intermediates_feed_nothing_else_in_gelu_new_order(helpers, variant, fused):
    """An intermediate read outside the GELU and its backward, or another order of the ops, keeps the GELU
    as captured; either way gradients are eager's."""
    torch.manual_seed(0)
    model, batch = GeluMLP(variant).to(helpers.device), (torch.randn(6, 8).to(helpers.device),)
    loss_fn = lambda m, x: m(x).square().sum()               # noqa: E731
    g = runtime.capture(model, loss_fn, batch)
    targets = _targets(g)
    fused = fused and helpers.device.type == "cpu"        # fused in CPU graphs only (runtime/tracing/capture.py)
    assert [op in targets for op in (*FUSED, "aten.tanh_backward.default")] == [fused] * 3 + [not fused]
    planned = helpers.train_like_eager_bitwise(model, loss_fn, batch, g)
    helpers.assert_peak_matches(planned.peak, _peak(g))


class GeluLM(nn.Module):
    """Embedding, linear, the written-out GELU and a linear head onto 256 classes: both fused rewrites apply."""

    def __init__(self):
        super().__init__()
        self.embed, self.up, self.head = nn.Embedding(256, 16), nn.Linear(16, 64), nn.Linear(64, 256, bias=False)

    def forward(self, ids):
        return self.head(gelu_new(self.up(self.embed(ids))))


def test_rewrites_see_through_detach_chains_as_torch_2_11_saves_tensors(helpers, monkeypatch):
    """torch 2.11's joint graph saves tensors for the backward through `aten.detach` chains where torch 2.14
    uses `aten.alias` (seen on a GPU host, where neither rewrite applied before). With every `aten.alias`
    of the exported graph turned into `aten.detach`, the GELU and the loss are fused all the same (on the
    CPU: GPU graphs keep them as captured), and the step still trains bit-identically to eager."""
    real_strip = capture_module.strip_boundaries

    def strip_then_detach(graph):
        real_strip(graph)
        saving = [n for n in graph.nodes if n.target in (torch.ops.aten.alias.default, torch.ops.aten.detach.default)]
        assert saving                                   # the joint graph saved tensors through them
        for n in saving:
            n.target = torch.ops.aten.detach.default

    monkeypatch.setattr(capture_module, "strip_boundaries", strip_then_detach)
    torch.manual_seed(0)
    model, batch = GeluLM().to(helpers.device), (torch.randint(0, 256, (2, 32)).to(helpers.device),)

    def loss_fn(m, ids):
        logits = m(ids)
        labels = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:]
        return torch.nn.functional.cross_entropy(logits.view(-1, 256), labels.reshape(-1), ignore_index=-100)

    g = runtime.capture(model, loss_fn, batch)
    targets = _targets(g)
    assert [targets.count(t) for t in (*FUSED, "memplan.linear_cross_entropy.default")] == \
        [int(helpers.device.type == "cpu")] * 4
    helpers.train_like_eager_bitwise(model, loss_fn, batch, g)


def test_sigmoid_identity_is_within_2_5e_7_of_the_tanh_and_exact_at_the_ends():
    """`gelu_tanh_inner_by_sigmoid` (variant `sigmoid`) against the tanh op and against float64: not bit-identical
    (so the variant is priced on its own), within 2.5e-7 everywhere, 0 at 0, +-1 and NaN where tanh gives them."""
    torch.manual_seed(0)
    x = torch.cat([torch.randn(100_000) * 3, torch.tensor([0.0, 40.0, -40.0, float("inf"), float("-inf")])])
    t = torch.ops.memplan.gelu_tanh_inner(x, 3.0, 0.044715, C)
    s = fused_gelu.gelu_tanh_inner_by_sigmoid(x, 3.0, 0.044715, C)
    assert not torch.equal(s, t)
    assert float((s - t).abs().max()) <= 2.5e-7
    exact = torch.tanh(C * (x.double() + 0.044715 * x.double() ** 3))
    assert float((s.double() - exact).abs().max()) <= 2.5e-7
    assert s[-5:].tolist() == [0.0, 1.0, -1.0, 1.0, -1.0]
    assert torch.isnan(fused_gelu.gelu_tanh_inner_by_sigmoid(torch.tensor([float("nan")]), 3.0, 0.044715, C)).all()


def test_sigmoid_variant_runs_every_fused_tanh_within_tolerance_at_the_simulated_peak(helpers):
    """Rule `sigmoid` offers itself on each fused tanh (a GPU graph, not fused, on each `aten.tanh`); a plan running
    it there trains like eager within the tolerance (and not bit for bit: the variant did run), at the peak the
    simulator predicts for it."""
    from memplan.runtime.variants.offered import graph_variants
    model, batch = _gpt2(helpers.device)
    g = runtime.capture(model, lm_loss, batch)
    variants = graph_variants(g, ("sigmoid",))
    inner = [n.id for n in g.nodes if n.targets[0] == FUSED[0]]
    tanh = [n.id for n in g.nodes if n.targets[0] == "aten.tanh.default"]
    assert sorted(n for n, specs in variants.specs.items() if "sigmoid" in specs) == sorted(inner + tanh)
    if helpers.device.type != "cpu":                  # no fused GELU in GPU graphs (their tanh: test_variant_rules)
        assert inner == [] and len(tanh) == 2
        return
    assert tanh == []
    assert len(inner) == 2
    schedule = [{"compute": n.id, "impl": "sigmoid"} if n.id in inner else {"compute": n.id} for n in g.nodes]
    eager = helpers.train_eager(model, lm_loss, batch)
    planned = helpers.train_plan(model, lm_loss, batch, Plan(g.fingerprint, schedule), graph=g)
    helpers.assert_same_step(eager, planned)
    assert not all(torch.equal(eager.grads[k], planned.grads[k]) for k in eager.grads)
    problem = Problem.from_graph(g, None, variants)
    helpers.assert_peak_matches(planned.peak, simulate(problem, schedule).peak_bytes)
