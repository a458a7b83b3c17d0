"""runtime/chunked_loss.py: the chunked head + cross-entropy equals the unchunked F.linear + F.cross_entropy, loss
and gradients, and its step's peak leaves out the full logits.

Tolerances: fp32 results agree to rtol 1e-5 / atol 1e-6, not bit for bit. The chunked loss sums per-chunk partial
sums (a different summation order for the loss and the weight/bias gradients, which add chunks' matrix products
instead of one product over all tokens) and computes the softmax as exp(logit - logsumexp) rather than
log_softmax's kernel, so results differ in their last few bits (observed: ~1e-7 relative). bf16 inputs are
compared with an fp32 reference on the same bf16 values: the chunked loss computes in fp32, so the loss agrees
to fp32 rounding, and the gradients to bf16's rounding of the result (rtol 1e-2, 8 bits of mantissa)."""

import pytest
import torch
import torch.nn.functional as F

from memplan.runtime.chunked_loss import (ChunkedCausalLMLoss, causal_lm_chunked_loss, chunked_causal_lm_loss,
                                          chunked_linear_cross_entropy)
from memplan.runtime.measure.meter import PeakMeter

FP32 = dict(rtol=1e-5, atol=1e-6)


def inputs(tokens=37, hidden=16, vocab=50, bias=False, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.3).to(dtype).requires_grad_()
    b = (torch.randn(vocab, generator=g) * 0.1).to(dtype).requires_grad_() if bias else None
    t = torch.randint(0, vocab, (tokens,), generator=g)
    return h, w, b, t


def grads(loss, tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None])


def reference(h, w, b, t, reduction="mean", softcap=None, ignore_index=-100):
    logits = F.linear(h.float(), w.float(), None if b is None else b.float())
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return F.cross_entropy(logits, t, ignore_index=ignore_index, reduction=reduction)


def check(h, w, b, t, *, chunk_tokens, tol=FP32, **kw):
    expected = reference(h, w, b, t, **kw)
    expected_grads = grads(expected, (h, w, b))
    got = chunked_linear_cross_entropy(h, w, t, bias=b, chunk_tokens=chunk_tokens, **kw)
    got_grads = grads(got, (h, w, b))
    torch.testing.assert_close(got, expected.float(), **FP32)
    for g, e, x in zip(got_grads, expected_grads, [x for x in (h, w, b) if x is not None]):
        assert g.dtype == x.dtype
        torch.testing.assert_close(g, e.to(x.dtype), **tol)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk_tokens", [1, 8, 10, 37, 1000])          # 37 tokens: 10 leaves an uneven last chunk
def test_matches_unchunked(reduction, chunk_tokens):
    check(*inputs(), chunk_tokens=chunk_tokens, reduction=reduction)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_ignore_index_including_a_whole_chunk(reduction):
    h, w, b, t = inputs(tokens=40)
    t[3] = t[17] = -100
    t[20:30] = -100                                     # chunk 2 of 4 (tokens 20..29) entirely ignored
    check(h, w, b, t, chunk_tokens=10, reduction=reduction)
    t[:] = 7
    t[::3] = 5
    t[5], t[6] = -1, -1
    check(h, w, b, t, chunk_tokens=10, reduction=reduction, ignore_index=-1)


def test_all_ignored_is_nan_for_mean_and_zero_for_sum():
    h, w, b, t = inputs(tokens=12)
    t[:] = -100
    assert torch.isnan(chunked_linear_cross_entropy(h, w, t, chunk_tokens=5))
    loss = chunked_linear_cross_entropy(h, w, t, chunk_tokens=5, reduction="sum")
    assert loss.item() == 0.0
    gh, gw = grads(loss, (h, w))
    assert not gh.any() and not gw.any()


def test_bias():
    check(*inputs(bias=True), chunk_tokens=8)
    check(*inputs(bias=True), chunk_tokens=8, reduction="sum")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_softcap(reduction):
    h, w, b, t = inputs(bias=True)
    w.data *= 10                                        # logits well past the cap, where tanh bends
    check(h, w, b, t, chunk_tokens=8, softcap=3.0, reduction=reduction)


def test_tied_weights_accumulate_the_embeddings_gradient():
    torch.manual_seed(0)
    vocab, width = 40, 12
    ids = torch.randint(0, vocab, (3, 9))

    def run(chunked):
        torch.manual_seed(1)
        emb = torch.nn.Embedding(vocab, width)
        mix = torch.nn.Linear(width, width)
        hidden = torch.tanh(mix(emb(ids)))
        if chunked:
            loss = causal_lm_chunked_loss(hidden, emb.weight, ids, chunk_tokens=4)
        else:
            logits = F.linear(hidden, emb.weight)
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))
        loss.backward()
        return loss, emb.weight.grad, mix.weight.grad, mix.bias.grad

    for got, expected in zip(run(True), run(False)):
        torch.testing.assert_close(got, expected, **FP32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_against_an_fp32_reference(dtype):
    h, w, b, t = inputs(tokens=33, hidden=32, vocab=64, bias=True, dtype=dtype)
    w.data *= 2
    t[4] = -100
    got = chunked_linear_cross_entropy(h, w, t, bias=b, chunk_tokens=8, softcap=5.0)
    assert got.dtype == torch.float32
    got_grads = grads(got, (h, w, b))
    h32, w32, b32 = (x.detach().float().requires_grad_() for x in (h, w, b))
    expected = reference(h32, w32, b32, t, softcap=5.0)
    torch.testing.assert_close(got, expected, **FP32)
    for g, e in zip(got_grads, grads(expected, (h32, w32, b32))):
        assert g.dtype == dtype
        torch.testing.assert_close(g.float(), e, rtol=1e-2, atol=1e-4)


def test_hidden_with_batch_dims_and_shape_errors():
    h, w, b, t = inputs(tokens=24)
    got = chunked_linear_cross_entropy(h.reshape(4, 6, -1), w, t.reshape(4, 6), chunk_tokens=5)
    torch.testing.assert_close(got, reference(h, w, b, t), **FP32)
    with pytest.raises(ValueError, match="differ"):
        chunked_linear_cross_entropy(h, w, t[:-1])
    with pytest.raises(ValueError, match="reduction"):
        chunked_linear_cross_entropy(h, w, t, reduction="none")


def test_no_logits_saved_for_backward():
    """The autograd graph holds the inputs and one fp32 number a token (logsumexp), nothing vocabulary-sized."""
    h, w, b, t = inputs(tokens=64, hidden=8, vocab=512)
    loss = chunked_linear_cross_entropy(h, w, t, chunk_tokens=16)
    saved = [x for x in loss.grad_fn.saved_tensors if x is not None]
    inputs_ = {h.data_ptr(), w.data_ptr()}
    assert max(x.numel() for x in saved if x.data_ptr() not in inputs_) <= 64


def transformers_models():
    transformers = pytest.importorskip("transformers")
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0))
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False))
    return {"gpt2": gpt2, "llama": llama}


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_transformers_causal_lm_end_to_end(name):
    torch.manual_seed(0)
    model = transformers_models()[name]
    ids = torch.randint(0, 97, (2, 19))
    labels = ids.clone()
    labels[0, :5] = -100                                # a prompt left out of the loss

    def step(fn):
        model.zero_grad(set_to_none=True)
        loss = fn()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    for lab in (None, labels):
        expected, expected_grads = step(lambda: model(ids, labels=ids if lab is None else lab).loss)
        got, got_grads = step(lambda: chunked_causal_lm_loss(model, ids, lab, chunk_tokens=7))
        torch.testing.assert_close(got, expected, **FP32)
        assert got_grads.keys() == expected_grads.keys()
        for key in expected_grads:
            torch.testing.assert_close(got_grads[key], expected_grads[key], rtol=1e-5, atol=1e-6, msg=key)
    if name == "gpt2":                                  # the head is tied to the token embedding
        assert model.lm_head.weight is model.transformer.wte.weight
    got = ChunkedCausalLMLoss(model, chunk_tokens=5)(ids, num_items_in_batch=torch.tensor(11))
    expected = model(ids, labels=ids, num_items_in_batch=torch.tensor(11)).loss
    torch.testing.assert_close(got, expected, **FP32)


def test_a_vocab_8192_heads_peak_leaves_out_the_full_logits():
    """tokens x 8192 fp32 logits are 16 MiB; a chunk of 64 tokens' are 2 MiB. The unchunked step holds the logits,
    the log-probabilities and their gradient (several full-logits tensors at once); the chunked one at most a
    couple of chunks' (the chunk's logits/softmax, a matrix product's result) besides the weight gradient, which
    both have. So the chunked peak is below the unchunked one by at least full - 2 chunks."""
    torch.manual_seed(0)
    tokens, width, vocab, chunk = 512, 64, 8192, 64
    h = torch.randn(tokens, width, requires_grad=True)
    w = (torch.randn(vocab, width) * 0.05).requires_grad_()
    t = torch.randint(0, vocab, (tokens,))
    full, chunk_bytes = tokens * vocab * 4, chunk * vocab * 4

    def peak(fn):
        h.grad = w.grad = None
        with PeakMeter("cpu", allocator=True) as meter:
            fn().backward()
        return meter.peak_bytes

    unchunked = peak(lambda: F.cross_entropy(h @ w.t(), t))
    chunked = peak(lambda: chunked_linear_cross_entropy(h, w, t, chunk_tokens=chunk))
    assert unchunked >= 2 * full                        # logits + log-probabilities at least
    assert chunked <= unchunked - (full - 2 * chunk_bytes), (chunked, unchunked)
    weight_grad = vocab * width * 4
    assert chunked <= weight_grad + 3 * chunk_bytes + 2 * tokens * width * 4, chunked
