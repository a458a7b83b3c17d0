"""The compiled form: memplan's solver decides which forward nodes of torch.compile's joint graph the backward
recomputes, inductor's partitioner honours it and inductor compiles the step (CPU, C++ backend)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memplan.runtime.compiled.records import Decision
from memplan.runtime.compiled.step import CompiledStep
from memplan.runtime.measure.meter import PeakMeter
from memplan.tasks.compiled.form import FractionDecision, joint_problem, recomputed_forward


class Decoder(nn.Module):
    """Two pre-norm blocks (SDPA attention, tanh-GELU MLP) and an untied head: one graph for torch.compile."""

    def __init__(self, vocab: int = 256, width: int = 64, layers: int = 2, seq: int = 32) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(nn.ModuleDict(dict(ln1=nn.LayerNorm(width), qkv=nn.Linear(width, 3 * width),
                                                       proj=nn.Linear(width, width), ln2=nn.LayerNorm(width),
                                                       fc=nn.Linear(width, 4 * width), out=nn.Linear(4 * width, width)))
                                    for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        for b in self.blocks:
            n, t, d = x.shape
            q, k, v = (z.view(n, t, 2, d // 2).transpose(1, 2) for z in b["qkv"](b["ln1"](x)).split(d, dim=-1))
            x = x + b["proj"](F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(n, t, d))
            x = x + b["out"](F.gelu(b["fc"](b["ln2"](x)), approximate="tanh"))
        return self.head(self.ln(x))


def loss_fn(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


@pytest.fixture(scope="module")
def runs():
    """Eager gradients, and per fraction of the no-recomputation peak: the compiled step's partitions, its
    gradients and the measured peak of the step after the compiling one."""
    torch.manual_seed(0)
    base, ids = Decoder(), torch.randint(0, 256, (4, 32))
    eager = copy.deepcopy(base)
    loss_fn(eager, ids).backward()
    out = {"eager": {n: p.grad for n, p in eager.named_parameters()}}
    for fraction in (1.0, 0.5):
        model = copy.deepcopy(base)
        decide = FractionDecision("dtr", fraction)
        step = CompiledStep(lambda x, m=model: loss_fn(m, x), decide)
        step(ids).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        with PeakMeter("cpu", allocator=True) as meter:
            step(ids).backward()
        out[fraction] = (step.partitioned, decide.solutions, grads, meter.peak_bytes)
    return out


def test_the_compiled_step_recomputes_what_the_solver_decided_and_saves_none_of_it(runs):
    (full,), _, _, _ = runs[1.0]
    (cut,), (solution,), _, _ = runs[0.5]
    assert not full.recomputed and solution.feasible and cut.recomputed
    assert not cut.recomputed & set(cut.saved), "a node tagged for recomputation was saved"
    assert cut.fingerprint == full.fingerprint, "both steps partition the same joint graph"


def test_the_compiled_form_trains_like_eager(runs):
    for fraction in (1.0, 0.5):
        grads = runs[fraction][2]
        for name, expected in runs["eager"].items():
            scale = expected.abs().max().item()
            torch.testing.assert_close(grads[name], expected, rtol=1e-4, atol=1e-5 * max(1.0, scale), msg=name)


def test_a_lower_fraction_saves_and_measures_less(runs):
    (full,), _, _, full_peak = runs[1.0]
    (cut,), _, _, cut_peak = runs[0.5]
    assert cut.saved_bytes < full.saved_bytes
    assert cut_peak < full_peak


def test_a_decision_that_names_no_forward_node_is_refused():
    model, ids = Decoder(layers=1), torch.randint(0, 256, (2, 32))
    step = CompiledStep(lambda x: loss_fn(model, x), lambda joint: Decision(recompute=frozenset({"no_such_node"})))
    with pytest.raises(Exception, match="no_such_node.*which are not forward nodes of this joint graph"):
        step(ids)


def test_recomputed_forward_names_the_forward_nodes_computed_twice():
    from memplan.runtime.compiled.records import JointGraph, JointNode

    joint = JointGraph(nodes=(JointNode("a", "aten.mm.default", "forward", (0, 1), (2,), 8),
                              JointNode("b", "aten.relu.default", "forward", (2,), (3,), 0),
                              JointNode("c", "aten.mul.Tensor", "backward", (2, 3), (4,), 0)),
                       value_bytes=(4, 4, 4, 4, 4), inputs=("x", "w"), outputs=(4,))
    problem = joint_problem(joint)
    assert problem.phase == ("forward", "forward", "backward") and problem.outputs == (4,)
    schedule = [("compute", 0), ("compute", 1), ("free", 2), ("compute", 0), ("compute", 2)]
    assert recomputed_forward(problem, schedule) == {"a"}


def test_a_value_one_fusible_reader_of_its_phase_alone_reads_takes_no_memory():
    """Inductor fuses a pointwise chain into one kernel: of mm -> exp -> neg -> add (forward) and mul (backward),
    only exp's result, which neg alone reads, never exists; mm's is a library kernel's, neg's has two readers,
    add's is read by the backward and mul's is a graph output."""
    from memplan.runtime.compiled.records import JointGraph, JointNode
    from memplan.tasks.compiled.form import fused_values

    nodes = (JointNode("mm", "aten.mm.default", "forward", (0, 1), (2,), 64),     # extern: always materialized
             JointNode("exp", "aten.exp.default", "forward", (2,), (3,), 0),      # read by neg alone: fused
             JointNode("neg", "aten.neg.default", "forward", (3,), (4,), 0),      # read by two ops
             JointNode("add", "aten.add.Tensor", "forward", (4,), (5,), 0),       # read by the backward
             JointNode("mul", "aten.mul.Tensor", "backward", (4, 5), (6,), 0))    # a graph output
    joint = JointGraph(nodes, value_bytes=(16,) * 7, inputs=("x", "w"), outputs=(6,))
    assert fused_values(joint) == {3}
    problem = joint_problem(joint)
    assert problem.value_bytes.tolist() == [16, 16, 16, 0, 16, 16, 16]


def _residual_joint():
    """arange (no input, read late) -> embed -> mm1 -> relu -> add (residual) -> mm2 (reads the arange) -> add2
    (residual) -> head -> loss, and a backward reading some of them."""
    from memplan.runtime.compiled.records import JointGraph, JointNode

    f = "forward"
    nodes = (JointNode("arange", "aten.arange.default", f, (), (3,), 0),
             JointNode("embed", "aten.embedding.default", f, (0, 1), (4,), 0),
             JointNode("mm1", "aten.mm.default", f, (4, 2), (5,), 8),
             JointNode("relu", "aten.relu.default", f, (5,), (6,), 0),
             JointNode("add", "aten.add.Tensor", f, (4, 6), (7,), 0),
             JointNode("mm2", "aten.mm.default", f, (7, 2, 3), (8,), 8),
             JointNode("add2", "aten.add.Tensor", f, (7, 8), (9,), 0),
             JointNode("head", "aten.mm.default", f, (9, 2), (10,), 8),
             JointNode("loss", "aten.sum.default", f, (10,), (11,), 0),
             JointNode("grad", "aten.mul.Tensor", "backward", (6, 7, 9, 10), (12,), 0))
    return JointGraph(nodes, value_bytes=(16,) * 13, inputs=("ids", "table", "w"), outputs=(11, 12))


def test_the_forward_is_cut_where_one_value_alone_carries_it_on():
    from memplan.tasks.compiled.form import forward_cuts, segment_cuts

    joint = _residual_joint()
    names = lambda idx: [joint.nodes[i].name for i in idx]  # noqa: E731
    assert names(forward_cuts(joint)) == ["embed", "add", "add2", "head"], "the arange, read late, cuts nothing"
    assert names(segment_cuts(joint)) == ["embed", "add", "add2", "head"]


def test_the_segment_candidates_resolve_their_tail_shares_on_the_graph_each_once():
    from memplan.tasks.compiled.form import segment_candidates

    assert segment_candidates(_residual_joint()) == [(1, 1, False), (1, 2, False), (1, 1, True), (1, 2, True)]


@pytest.mark.parametrize("stride, tail, recompute, save", [
    (1, 1, {"mm1", "relu", "mm2"}, {"embed", "add", "add2"}),
    (2, 1, {"mm1", "relu", "add", "mm2"}, {"embed", "add2"}),
    (1, 2, {"mm1", "relu"}, {"embed", "add"}),
])
def test_a_segment_decision_recomputes_between_the_saved_cuts_and_leaves_the_tail(stride, tail, recompute, save):
    from memplan.tasks.compiled.form import segment_decision

    decision = segment_decision(_residual_joint(), stride, tail)
    assert decision == Decision(frozenset(recompute), frozenset(save))
    assert segment_decision(_residual_joint(), 1, 3) is None, "no segment left to recompute"
    led = segment_decision(_residual_joint(), stride, tail, lead=True)
    assert led == Decision(frozenset(recompute | {"embed"}), frozenset(save - {"embed"})), "the arange is left"
    with pytest.raises(ValueError, match="at least 1"):
        segment_decision(_residual_joint(), 0, 1)


@pytest.fixture(scope="module")
def segment_runs(runs):
    """Per segment candidate: the compiled step's cut, its gradients and its measured peak."""
    from memplan.tasks.compiled.form import SegmentDecision

    torch.manual_seed(0)
    base, ids = Decoder(), torch.randint(0, 256, (4, 32))
    out = {}
    for stride, tail in ((1, 1), (2, 1)):
        model = copy.deepcopy(base)
        step = CompiledStep(lambda x, m=model: loss_fn(m, x), SegmentDecision(stride, tail))
        step(ids).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        with PeakMeter("cpu", allocator=True) as meter:
            step(ids).backward()
        out[stride, tail] = (step.partitioned[0], grads, meter.peak_bytes)
    return out


def test_a_segment_candidate_checkpoints_the_blocks_trains_like_eager_and_measures_less(runs, segment_runs):
    from memplan.tasks.compiled.form import segment_cuts

    (full,), _, _, full_peak = runs[1.0]
    for (stride, tail), (cut, grads, peak) in segment_runs.items():
        cuts = [cut.joint.nodes[i].name for i in segment_cuts(cut.joint)]
        assert len(cuts) == 2 + 2 * 2, "the embedding, two residual adds a block, the head"
        assert cut.fingerprint == full.fingerprint and cut.recomputed and not cut.recomputed & set(cut.saved)
        last = cuts[len(cuts) - 1 - tail]        # read by the tail alone, which the partitioner places
        assert set(cut.decision.save) - {last} <= set(cut.saved), "the cuts the recomputed segments read are saved"
        assert peak < full_peak and cut.saved_bytes < full.saved_bytes
        for name, expected in runs["eager"].items():
            scale = expected.abs().max().item()
            torch.testing.assert_close(grads[name], expected, rtol=1e-4, atol=1e-5 * max(1.0, scale), msg=name)


class DropoutDecoder(Decoder):
    """The decoder with dropout after the embedding and on each residual branch (random ops inside the segments)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = F.dropout(self.tok(ids) + self.pos(torch.arange(ids.shape[1])), 0.2, self.training)
        for b in self.blocks:
            n, t, d = x.shape
            q, k, v = (z.view(n, t, 2, d // 2).transpose(1, 2) for z in b["qkv"](b["ln1"](x)).split(d, dim=-1))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(n, t, d)
            x = x + F.dropout(b["proj"](a), 0.2, self.training)
            x = x + F.dropout(b["out"](F.gelu(b["fc"](b["ln2"](x)), approximate="tanh")), 0.2, self.training)
        return self.head(self.ln(x))


def test_a_segment_candidate_replays_dropouts_masks_when_it_recomputes_them():
    """Recomputed in the backward, a dropout draws the mask its forward drew: with inductor drawing as eager
    PyTorch does (`exact_random`), the gradients are eager's under the same seed."""
    from memplan.tasks.compiled.form import SegmentDecision

    torch.manual_seed(0)
    base, ids = DropoutDecoder(), torch.randint(0, 256, (4, 32))
    eager, model = copy.deepcopy(base), copy.deepcopy(base)
    torch.manual_seed(7)
    loss_fn(eager, ids).backward()
    step = CompiledStep(lambda x: loss_fn(model, x), SegmentDecision(2, 1), exact_random=True)
    torch.manual_seed(7)
    step(ids).backward()
    cut, = step.partitioned
    assert any("random" in n.target or "dropout" in n.target or "bernoulli" in n.target
               for n in cut.joint.nodes if n.name in cut.recomputed), "a random op is recomputed"
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        scale = q.grad.abs().max().item()
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5 * max(1.0, scale), msg=name)
