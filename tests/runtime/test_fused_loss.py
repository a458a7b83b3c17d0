"""The cross-entropy backward fused into one op (runtime/fused_loss.py) and its capture rewrite."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import runtime
import runtime.capture as capture_module
from runtime.meter import PeakMeter

aten = torch.ops.aten


@pytest.mark.parametrize("rows, classes, reduction, weighted", [(64, 2048, 1, False), (37, 11, 0, False),
                                                                 (37, 11, 2, True), (5, 3, 1, True)])
def test_fused_op_equals_the_two_aten_kernels_bit_for_bit(rows, classes, reduction, weighted):
    torch.manual_seed(0)
    log_probs = torch.randn(rows, classes).log_softmax(1)
    target = torch.randint(0, classes, (rows,))
    target[::7] = -100                                           # ignored rows
    weight = torch.rand(classes) if weighted else None
    _, total_weight = aten.nll_loss_forward(log_probs, target, weight, reduction, -100)
    grad_loss = torch.randn(rows) if reduction == 0 else torch.tensor(1.3)
    expected = aten._log_softmax_backward_data(
        aten.nll_loss_backward(grad_loss, log_probs, target, weight, reduction, -100, total_weight),
        log_probs, 1, torch.float32)
    fused = torch.ops.memplan.log_softmax_nll_backward(grad_loss, log_probs, target, weight, reduction, -100,
                                                        total_weight, torch.float32)
    assert torch.equal(fused, expected)


class TinyLM(nn.Module):
    """Token embedding and a linear head onto a vocabulary of 4096: the logits (2 MiB at 128 tokens)
    dwarf every other activation, so the loss's backward is the step's peak."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(4096, 16), nn.Linear(16, 4096)

    def forward(self, ids):
        return self.head(torch.tanh(self.embed(ids)))


def lm_loss(model, ids):
    logits = model(ids)[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), ignore_index=0)


def label_smoothed(model, ids):
    return F.cross_entropy(model(ids).flatten(0, 1), ids.flatten(), label_smoothing=0.1)


def _peak(graph) -> int:
    from tasks.solve.problem import Problem
    from tasks.solve.simulator import default_schedule, simulate
    problem = Problem.from_graph(graph)
    return simulate(problem, default_schedule(problem)).peak_bytes


def test_capture_fuses_the_loss_backward_saving_one_logits_tensor_with_eager_gradients(helpers, monkeypatch):
    torch.manual_seed(0)
    model, batch = TinyLM(), (torch.randint(0, 4096, (2, 65)),)
    g = runtime.capture(model, lm_loss, batch)
    fused = [n for n in g.nodes if n.targets[0] == "memplan.log_softmax_nll_backward.default"]
    assert len(fused) == 1 and fused[0].phase == "backward"
    ops = {t for n in g.nodes for t in n.targets}
    assert not ops & {"aten.nll_loss_backward.default", "aten._log_softmax_backward_data.default"}

    eager = helpers.train_eager(model, lm_loss, batch)
    planned = helpers.train_plan(model, lm_loss, batch, runtime.default_plan(g), graph=g)
    assert torch.equal(eager.loss, planned.loss)
    assert all(torch.equal(eager.grads[k], planned.grads[k]) for k in eager.grads)
    helpers.assert_peak_matches(planned.peak, _peak(g))

    monkeypatch.setattr(capture_module, "_fuse_cross_entropy_backward", lambda graph: None)
    unfused = runtime.capture(model, lm_loss, batch)
    logits_bytes = g.values[fused[0].outputs[0]].bytes
    assert logits_bytes == 128 * 4096 * 4
    assert _peak(unfused) - logits_bytes <= _peak(g) < _peak(unfused)   # one logits tensor at most


def test_a_loss_backward_of_another_shape_is_left_as_captured(helpers):
    """Label smoothing adds a second gradient into the log-softmax backward: nothing to fuse."""
    torch.manual_seed(0)
    model, batch = TinyLM(), (torch.randint(0, 4096, (2, 16)),)
    g = runtime.capture(model, label_smoothed, batch)
    assert not any(n.targets[0].startswith("memplan.") for n in g.nodes)
    assert any(n.targets[0] == "aten._log_softmax_backward_data.default" for n in g.nodes)
    eager = helpers.train_eager(model, label_smoothed, batch)
    planned = helpers.train_plan(model, label_smoothed, batch, runtime.default_plan(g), graph=g)
    assert all(torch.equal(eager.grads[k], planned.grads[k]) for k in eager.grads)


def test_the_fused_op_holds_no_temporary_beyond_its_result():
    """It writes the loss gradient into its result and the log-softmax backward over it in place."""
    log_probs = torch.randn(256, 1024).log_softmax(1)
    target = torch.randint(0, 1024, (256,))
    _, total_weight = aten.nll_loss_forward(log_probs, target, None, 1, -100)
    with PeakMeter("cpu") as meter:
        out = torch.ops.memplan.log_softmax_nll_backward(torch.tensor(1.0), log_probs, target, None, 1, -100,
                                                          total_weight, torch.float32)
    assert meter.peak_bytes == out.numel() * 4
