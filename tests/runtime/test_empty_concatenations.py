"""Copies made by concatenating onto an empty tensor (transformers' key/value cache) are dropped at capture."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memplan import runtime
import memplan.runtime.tracing.capture as capture_module
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import default_schedule, simulate

aten = torch.ops.aten
CAT = "aten.cat.default"


def _peak(graph) -> int:
    problem = Problem.from_graph(graph)
    return simulate(problem, default_schedule(problem)).peak_bytes


def _cats(graph) -> int:
    return sum(t == CAT for n in graph.nodes for t in n.targets)


def _gpt2(device):
    """transformers' defaults: the cache on (without it, and without an attention mask, the packed-sequence
    check on position ids is data-dependent and cannot be traced)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32, bos_token_id=0,
                        eos_token_id=0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config).train().to(device), (torch.randint(0, 128, (2, 32), device=device),)


def lm_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_attention_is_bit_identical_on_strided_and_contiguous_keys(causal, threads):
    """The claim behind `_STRIDED_READERS`: forward and backward of CPU flash attention give the same bits
    whether keys and values are views of the fused projection or contiguous copies of them."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        qkv = torch.randn(2, 64, 3 * 32)
        q, k, v = (t.view(2, 64, 2, 16).transpose(1, 2) for t in qkv.split(32, dim=2))
        kc, vc = k.contiguous(), v.contiguous()
        strided = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
        copied = aten._scaled_dot_product_flash_attention_for_cpu(q, kc, vc, 0.0, causal)
        assert all(torch.equal(a, b) for a, b in zip(strided, copied))
        grad = torch.randn_like(strided[0])
        back = [aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, key, value, out, lse, 0.0, causal)
                for key, value, (out, lse) in ((k, v, strided), (kc, vc, copied))]
        assert all(torch.equal(a, b) for a, b in zip(*back))
    finally:
        torch.set_num_threads(before)


def test_gpt2_cache_copies_are_dropped_and_it_trains_like_eager(helpers, monkeypatch):
    """GPT-2 with its default cache concatenates each layer's keys and values onto empty tensors. On CPU the
    captured graph has exactly those four copies (two layers) fewer than captured as is, its peak is at
    least their bytes lower, and it trains bit-identically to eager with the predicted peak."""
    model, batch = _gpt2(helpers.device)
    g = runtime.capture(model, lm_loss, batch)
    monkeypatch.setattr(capture_module, "_drop_empty_concatenations", lambda graph: None)
    as_traced = runtime.capture(model, lm_loss, batch)

    kv_bytes = 2 * 32 * 64 * 4                                   # one layer's keys: batch x seq x width, fp32
    if helpers.device.type == "cpu":
        assert (len(as_traced.nodes) - len(g.nodes), _cats(as_traced) - _cats(g)) == (4, 4)
        assert sum(v.bytes for v in as_traced.values) - sum(v.bytes for v in g.values) == 4 * kv_bytes
        assert _peak(as_traced) - _peak(g) >= 4 * kv_bytes
    else:                                                        # CUDA attention is not in _STRIDED_READERS
        assert _cats(as_traced) == _cats(g)

    planned = helpers.train_like_eager_bitwise(model, lm_loss, batch, g)
    helpers.assert_peak_matches(planned.peak, _peak(g))


class EmptyCat(nn.Module):
    """`cat([tensor([]), piece])` of a piece the `kind` names, read by an elementwise op. The transposed
    piece's copy is read only by an add that also reads the piece (an add's backward reads neither), so
    only its strides can keep the copy."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind, self.linear = kind, nn.Linear(8, 8)

    def forward(self, x):
        h = self.linear(x)                                       # 6 x 8, allocated
        piece = {"contiguous": h, "reshaped": h.view(8, 6), "transposed": h.t(),
                 "rows of a larger tensor": h[:3]}[self.kind]
        copy = torch.cat([torch.tensor([], device=x.device), piece])         # as transformers' cache starts
        return copy + piece if self.kind == "transposed" else torch.tanh(copy)


@pytest.mark.parametrize("kind, dropped", [("contiguous", True), ("reshaped", True), ("transposed", False),
                                           ("rows of a larger tensor", False)])
def test_an_empty_concatenation_is_dropped_only_where_it_is_exact_and_pins_nothing_larger(helpers, kind, dropped):
    """Dropped: a piece with the copy's strides that allocates its own storage or views one of the copy's
    size. Kept: a transposed piece read by an op outside `_STRIDED_READERS` (strides may change its bits),
    and a piece viewing a larger tensor its readers do not read (the copy would keep the larger tensor
    alive). Either way gradients are eager's."""
    torch.manual_seed(0)
    model, batch = EmptyCat(kind).to(helpers.device), (torch.randn(6, 8, device=helpers.device),)
    loss_fn = lambda m, x: m(x).square().sum()               # noqa: E731
    g = runtime.capture(model, loss_fn, batch)
    assert (_cats(g) == 0) is dropped
    helpers.train_like_eager_bitwise(model, loss_fn, batch, g)
