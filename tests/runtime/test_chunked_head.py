"""The chunked head and cross-entropy rewrite (`chunk_cross_entropy`, runtime/tracing/chunked_head.py): no
logits-sized tensor, eager's loss and gradients within the validation tolerance, and refusals."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

import memplan.runtime.tracing.rewrites as rewrites
from memplan import runtime
from memplan.runtime.tracing.program import CaptureError
from memplan.tasks.models import causal_lm
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import default_schedule, simulate

CHUNKED = ("memplan.chunked_cross_entropy.default", "memplan.chunked_cross_entropy_backward.default")
VOCAB = 2048


class Head(nn.Module):
    """Embedding, tanh and a linear head of its own (with a bias): `F.cross_entropy(F.linear(h, W, b), y)`."""

    def __init__(self, vocab: int = VOCAB, bias: bool = True):
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, 16), nn.Linear(16, vocab, bias=bias)

    def forward(self, ids):
        return self.head(torch.tanh(self.embed(ids)))


def head_loss(model, ids, target):
    logits = model(ids)
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _models() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0))
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False))
    return {"gpt2": gpt2, "llama": llama, "custom": Head()}


def _case(name: str):
    model = _models()[name]
    ids = torch.randint(0, VOCAB, (2, 32))
    if name == "custom":
        target = torch.randint(0, VOCAB, (2, 32))
        target[0] = -100                                  # a whole chunk of ignored rows, and scattered ones
        target[1, ::5] = -100
        return model, head_loss, (ids, target)
    return model, causal_lm, (ids,)


def _peak(graph) -> int:
    problem = Problem.from_graph(graph)
    return simulate(problem, default_schedule(problem)).peak_bytes


def _ops(graph) -> set[str]:
    return {t for n in graph.nodes for t in n.targets}


@pytest.mark.parametrize("name", ["gpt2", "llama", "custom"])
def test_the_head_and_loss_are_chunked_and_train_like_eager_within_tolerance(helpers, monkeypatch, name):
    """GPT-2 (the head's weight is the embedding's), Llama (untied, no bias) and a head of one's own with a bias
    and ignored rows: capture (checking the instance on this step's values, as by default) rewrites the loss
    into the chunked ops, no value is logits-sized, and the plan's loss and gradients are eager's within the
    validation tolerance."""
    if helpers.device.type != "cpu":
        pytest.skip("the chunked rewrite applies to CPU graphs (docs/graph-format.md)")
    monkeypatch.setattr(rewrites, "CHUNK_LOGITS_BYTES", 0)   # the default applies it to logits of 64 MiB and more
    model, loss_fn, batch = _case(name)
    g = runtime.capture(model, loss_fn, batch)
    record = g.meta["rewrites"]
    assert record["applied"]["chunk_cross_entropy"] == [0] and record["inexact"]["chunk_cross_entropy"] == []
    assert record["within_tolerance"] == {"chunk_cross_entropy": {"rtol": 1e-4, "atol": 1e-5}}
    assert set(CHUNKED) <= _ops(g)
    assert not _ops(g) & {"memplan.linear_cross_entropy.default", "aten._log_softmax.default",
                          "aten.nll_loss_backward.default"}
    rows = math.prod(batch[0].shape)
    assert max(v.bytes for v in g.values if v.kind == "activation") < rows * VOCAB * 4 / 4   # a chunk's at most
    eager = helpers.train_eager(model, loss_fn, batch)
    planned = helpers.train_plan(model, loss_fn, batch, runtime.default_plan(g), graph=g)
    helpers.assert_same_step(eager, planned, rtol=1e-4, atol=1e-5)   # tasks/validate/stage.py step_tolerance's fp32


def test_the_chunked_graph_holds_no_logits_tensor_where_the_fused_one_holds_one(helpers):
    """Where the logits dominate the step, the chunked graph's simulated peak is below the fused graph's by most of
    one logits tensor, and its measured peak exceeds its simulated one by at most the ops' workspace (a chunk's
    logits and its logsumexp's temporary, which the profile measures per node)."""
    if helpers.device.type != "cpu":
        pytest.skip("the chunked rewrite applies to CPU graphs")
    torch.manual_seed(0)
    vocab = 4096
    model = Head(vocab, bias=False)
    ids, target = torch.randint(0, vocab, (2, 64)), torch.randint(0, vocab, (2, 64))
    chunked = runtime.capture(model, head_loss, (ids, target), rewrites={"chunk_cross_entropy": [0]})
    fused = runtime.capture(model, head_loss, (ids, target), rewrites={"fuse_cross_entropy": [0]})
    assert "memplan.linear_cross_entropy.default" in _ops(fused) and set(CHUNKED) <= _ops(chunked)
    logits = 128 * vocab * 4
    assert _peak(chunked) <= _peak(fused) - 0.75 * logits
    planned = helpers.train_plan(model, head_loss, (ids, target), runtime.default_plan(chunked), graph=chunked)
    fused_run = helpers.train_plan(model, head_loss, (ids, target), runtime.default_plan(fused), graph=fused)
    chunk_logits = -(-128 // rewrites.CHUNKS) * vocab * 4
    assert _peak(chunked) <= planned.peak <= _peak(chunked) + 2 * chunk_logits + 64 * 1024
    assert planned.peak <= fused_run.peak - 0.75 * logits


def test_the_default_chunks_only_large_logits():
    """Below `CHUNK_LOGITS_BYTES` of logits the instance is found but not applied (the fused loss is kept)."""
    torch.manual_seed(0)
    model = Head(bias=False)
    g = runtime.capture(model, head_loss, (torch.randint(0, VOCAB, (2, 8)), torch.randint(0, VOCAB, (2, 8))),
                        verify=False)
    assert g.meta["rewrites"]["found"]["chunk_cross_entropy"] == 1
    assert g.meta["rewrites"]["applied"]["chunk_cross_entropy"] == []
    assert "within_tolerance" not in g.meta["rewrites"]
    assert "memplan.linear_cross_entropy.default" in _ops(g)


def test_an_instance_beyond_the_tolerance_is_not_applied(monkeypatch):
    """The check keeps an instance only within its pass's tolerance: at zero tolerance the chunked sums (another
    summation order) fail it, and the graph keeps the fused loss."""
    monkeypatch.setattr(rewrites, "CHUNK_LOGITS_BYTES", 0)
    monkeypatch.setitem(rewrites.WITHIN_TOLERANCE, "chunk_cross_entropy", (0.0, 0.0))
    torch.manual_seed(0)
    model = Head(bias=False)
    ids, target = torch.randint(0, VOCAB, (2, 32)), torch.randint(0, VOCAB, (2, 32))
    g = runtime.capture(model, head_loss, (ids, target))
    assert g.meta["rewrites"]["inexact"]["chunk_cross_entropy"] == [0]
    assert g.meta["rewrites"]["applied"]["chunk_cross_entropy"] == []
    assert not set(CHUNKED) & _ops(g)


def smoothed(model, ids, target):
    return F.cross_entropy(model(ids).flatten(0, 1), target.flatten(), label_smoothing=0.1)


def class_weighted(model, ids, target):
    return F.cross_entropy(model(ids).flatten(0, 1), target.flatten(), weight=torch.linspace(0.5, 1.5, VOCAB))


def per_token(model, ids, target):
    return F.cross_entropy(model(ids).flatten(0, 1), target.flatten(), reduction="none").mean()


def logits_read_again(model, ids, target):
    logits = model(ids)
    return F.cross_entropy(logits.flatten(0, 1), target.flatten()) + 1e-3 * logits.square().mean()


@pytest.mark.parametrize("loss_fn", [smoothed, class_weighted, per_token, logits_read_again])
def test_losses_it_cannot_compute_are_left_alone(loss_fn):
    """Label smoothing, class weights, no reduction and logits read beyond the loss are not chunked: no candidate,
    so a selection asking for one is refused rather than computing another loss."""
    torch.manual_seed(0)
    model = Head(bias=False)
    batch = (torch.randint(0, VOCAB, (2, 8)), torch.randint(0, VOCAB, (2, 8)))
    g = runtime.capture(model, loss_fn, batch, verify=False)
    assert g.meta["rewrites"]["found"]["chunk_cross_entropy"] == 0
    with pytest.raises(CaptureError, match="chunk_cross_entropy"):
        runtime.capture(model, loss_fn, batch, rewrites={"chunk_cross_entropy": [0]})


def test_the_profile_sees_a_chunk_of_logits_as_the_ops_workspace(helpers):
    """The chunk's logits live inside the ops (their results are small): the profile measures them as each node's
    workspace, which the planners and the simulator charge, below one whole logits tensor."""
    if helpers.device.type != "cpu":
        pytest.skip("the chunked rewrite applies to CPU graphs")
    from memplan.tasks.profile.stage import ProfileSettings, measure_graph

    torch.manual_seed(0)
    vocab = 4096
    model = Head(vocab)
    batch = (torch.randint(0, vocab, (2, 64)), torch.randint(0, vocab, (2, 64)))
    g = runtime.capture(model, head_loss, batch, rewrites={"chunk_cross_entropy": [0]})
    rows = {r["op"]: r for r in measure_graph(g, "cpu", ProfileSettings(), progress=False) if r["impl"] == "default"}
    chunk_logits, logits = -(-128 // rewrites.CHUNKS) * vocab * 4, 128 * vocab * 4
    for op in CHUNKED:
        assert chunk_logits <= rows[op]["workspace_bytes"] < logits / 2, op
