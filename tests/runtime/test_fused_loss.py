"""Cross-entropy with fewer logits-sized tensors (runtime/tracing/fused_loss.py) and its capture rewrite."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memplan import runtime
import memplan.runtime.tracing.fused_loss as fused_loss
from memplan.runtime.measure.meter import PeakMeter
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import default_schedule, simulate

aten = torch.ops.aten
LINEAR_CE = "memplan.linear_cross_entropy.default"
BACKWARD = "memplan.log_softmax_nll_backward.default"


def _loss_inputs(rows: int, classes: int, reduction: int, weighted: bool, device):
    torch.manual_seed(0)
    target = torch.randint(0, classes, (rows,))
    target[::7] = -100                                           # ignored rows
    return target.to(device), (torch.rand(classes).to(device) if weighted else None)


def _aten_loss(logits, target, weight, reduction):
    """The ATen ops AOTAutograd captures for cross-entropy and its backward (seed: ones)."""
    log_probs = aten._log_softmax(logits, 1, False)
    loss, total_weight = aten.nll_loss_forward(log_probs, target, weight, reduction, -100)
    grad = aten._log_softmax_backward_data(
        aten.nll_loss_backward(torch.ones_like(loss), log_probs, target, weight, reduction, -100, total_weight),
        log_probs, 1, logits.dtype)
    return log_probs, loss, total_weight, grad


CASES = [(64, 2048, 1, False), (37, 11, 0, False), (37, 11, 2, True), (5, 3, 1, True)]


@pytest.mark.parametrize("rows, classes, reduction, weighted", CASES)
def test_backward_op_equals_the_two_aten_kernels_bit_for_bit(helpers, rows, classes, reduction, weighted):
    target, weight = _loss_inputs(rows, classes, reduction, weighted, helpers.device)
    logits = torch.randn(rows, classes).to(helpers.device)
    log_probs, loss, total_weight, expected = _aten_loss(logits, target, weight, reduction)
    fused = torch.ops.memplan.log_softmax_nll_backward(torch.ones_like(loss), log_probs, target, weight, reduction,
                                                        -100, total_weight, torch.float32)
    assert torch.equal(fused, expected)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows, classes, reduction, weighted", CASES)
def test_whole_loss_op_equals_the_aten_ops_bit_for_bit_in_any_number_of_blocks(helpers, rows, classes, reduction,
                                                                               weighted, bias, monkeypatch):
    target, weight = _loss_inputs(rows, classes, reduction, weighted, helpers.device)
    x, w_t, b = (t.to(helpers.device) for t in (torch.randn(rows, 16), torch.randn(16, classes), torch.randn(classes)))
    logits = aten.addmm(b, x, w_t) if bias else aten.mm(x, w_t)
    _, loss, total_weight, grad = _aten_loss(logits, target, weight, reduction)
    for blocks, block_bytes in ((rows, 1), (fused_loss.BLOCKS, fused_loss.BLOCK_BYTES)):   # one row each; default
        monkeypatch.setattr(fused_loss, "BLOCKS", blocks)
        monkeypatch.setattr(fused_loss, "BLOCK_BYTES", block_bytes)
        got = torch.ops.memplan.linear_cross_entropy(b if bias else None, x, w_t, target, weight, reduction, -100)
        assert all(torch.equal(a, e) for a, e in zip(got, (loss, total_weight, grad)))


def test_fused_ops_hold_one_logits_tensor():
    """The backward op writes the loss gradient into its result and the log-softmax backward over it; the
    whole-loss op computes the logits, log-probabilities and gradient in one storage, with one block of
    scratch rows: all it allocates is in its results, where the meter and the planners count it."""
    torch.manual_seed(0)
    x, w_t, target = torch.randn(256, 16), torch.randn(16, 1024), torch.randint(0, 1024, (256,))
    log_probs, loss, total_weight, _ = _aten_loss(x @ w_t, target, None, 1)
    seed = torch.ones_like(loss)
    with PeakMeter("cpu") as meter:
        out = torch.ops.memplan.log_softmax_nll_backward(seed, log_probs, target, None, 1, -100, total_weight,
                                                          torch.float32)
    assert meter.peak_bytes == out.numel() * 4
    with PeakMeter("cpu") as meter:
        *_, grad = torch.ops.memplan.linear_cross_entropy(None, x, w_t, target, None, 1, -100)
    scratch = fused_loss.block_rows(256, 1024 * 4) * 1024 * 4      # one block of rows ahead of the logits'
    assert grad.untyped_storage().nbytes() == grad.numel() * 4 + scratch == 17 * 64 * 1024
    assert meter.peak_bytes == grad.untyped_storage().nbytes() + 8   # and the loss and total weight scalars


class TinyLM(nn.Module):
    """Token embedding and a linear head onto a vocabulary of 4096: the logits (2 MiB at 128 tokens)
    dwarf every other activation, so the loss is the step's peak."""

    def __init__(self, bias: bool = False):
        super().__init__()
        self.embed, self.head = nn.Embedding(4096, 16), nn.Linear(16, 4096, bias=bias)

    def forward(self, ids):
        return self.head(torch.tanh(self.embed(ids)))


def padded_lm_loss(model, ids):
    """transformers' causal-LM loss: the labels shifted by padding, the logits used as they are."""
    logits = model(ids)
    labels = F.pad(ids, (0, 1), value=-100)[:, 1:]
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


def sliced_lm_loss(model, ids):
    """The logits sliced (a copy of them feeds the loss, not the head's product)."""
    logits = model(ids)[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def scaled_lm_loss(model, ids):
    """Twice the loss: the loss backward's seed is not ones_like(loss)."""
    return 2 * padded_lm_loss(model, ids)


def label_smoothed(model, ids):
    return F.cross_entropy(model(ids).flatten(0, 1), ids.flatten(), label_smoothing=0.1)


def _peak(graph) -> int:
    problem = Problem.from_graph(graph)
    return simulate(problem, default_schedule(problem)).peak_bytes


def _check_trains_like_eager(helpers, model, loss_fn, batch, g):
    planned = helpers.train_like_eager_bitwise(model, loss_fn, batch, g)
    helpers.assert_peak_matches(planned.peak, _peak(g))


@pytest.mark.parametrize("loss_fn, bias, fused_op, logits_fewer", [
    (padded_lm_loss, False, LINEAR_CE, 2), (padded_lm_loss, True, LINEAR_CE, 2),
    (sliced_lm_loss, False, BACKWARD, 1), (scaled_lm_loss, False, BACKWARD, 1)])
def test_capture_fuses_the_loss_saving_logits_tensors_with_eager_gradients(helpers, monkeypatch, loss_fn, bias,
                                                                             fused_op, logits_fewer):
    torch.manual_seed(0)
    model, batch = TinyLM(bias).to(helpers.device), (torch.randint(0, 4096, (2, 64)).to(helpers.device),)
    g = runtime.capture(model, loss_fn, batch)
    fused = [n for n in g.nodes if n.targets[0].startswith("memplan.")]
    if helpers.device.type != "cpu":                  # fused in CPU graphs only (runtime/tracing/capture.py)
        assert fused == []
        _check_trains_like_eager(helpers, model, loss_fn, batch, g)
        return
    assert [n.targets[0] for n in fused] == [fused_op]
    assert not {t for n in g.nodes for t in n.targets} & {"aten.nll_loss_backward.default",
                                                          "aten._log_softmax_backward_data.default"}
    _check_trains_like_eager(helpers, model, loss_fn, batch, g)

    unfused = runtime.capture(model, loss_fn, batch,
                              rewrites={**g.meta["rewrites"]["applied"], "fuse_cross_entropy": []})
    logits = max(math.prod(g.values[v].shape) * 4 for v in fused[0].outputs)
    assert logits >= 126 * 4096 * 4
    # captured as is, three logits-sized tensors meet at the loss backward, the step's peak; fused, fewer
    # (beside one block of scratch rows, 1/16 of the logits, and the embedding and head gradients, 1/4)
    assert _peak(unfused) >= 3 * logits
    assert _peak(g) < (3 - logits_fewer + 0.35) * logits


def test_a_loss_backward_of_another_shape_is_left_as_captured(helpers):
    """Label smoothing adds a second gradient into the log-softmax backward: nothing to fuse."""
    torch.manual_seed(0)
    model, batch = TinyLM().to(helpers.device), (torch.randint(0, 4096, (2, 16)).to(helpers.device),)
    g = runtime.capture(model, label_smoothed, batch)
    assert not any(n.targets[0].startswith("memplan.") for n in g.nodes)
    assert any(n.targets[0] == "aten._log_softmax_backward_data.default" for n in g.nodes)
    _check_trains_like_eager(helpers, model, label_smoothed, batch, g)


def test_the_whole_loss_fuses_when_the_backward_seed_comes_through_an_alias():
    """Autograd's engine aliases a gradient it cannot steal, which depends on the tensor's reference count at that
    moment: the same step may trace with `nll_loss_backward(alias(ones_like(loss)))`. Both traces must fuse into
    one `memplan::linear_cross_entropy` and leave the same ops (the graph's fingerprint must not depend on it)."""
    from torch._functorch.aot_autograd import aot_export_module

    from memplan.runtime.tracing.capture import _LossStep
    from memplan.runtime.tracing.rewrites import Rewriter, fuse_cross_entropy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    batch = (torch.randn(32, 8), torch.randint(0, 4, (32,)))

    def fused_ops(alias_the_seed: bool) -> list[str]:
        gm, _ = aot_export_module(_LossStep(model, lambda m, x, y: F.cross_entropy(m(x), y)), batch,
                                  trace_joint=True, output_loss_index=0)
        if alias_the_seed:
            seed = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.ones_like.default)
            with gm.graph.inserting_after(seed):
                alias = gm.graph.call_function(torch.ops.aten.alias.default, (seed,))
            alias.meta = dict(seed.meta)
            seed.replace_all_uses_with(alias, delete_user_cb=lambda user: user is not alias)
        rw = Rewriter(gm.graph, None)
        fuse_cross_entropy(gm.graph, rw, on_cpu=True)
        assert rw.applied == [0]
        return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]

    plain, aliased = fused_ops(False), fused_ops(True)
    assert "memplan.linear_cross_entropy.default" in plain
    assert aliased == plain
