"""What a policy-form decision may save (runtime/policy/form.py): any allocating node of a region up to the
last its backward reads, e.g. a projection only recomputed ops read (torchtitan's op lists keep those); a
save nothing reads before the recomputation reaches it is refused (`idle_saves`) or dropped (`settled`);
dropout's mask buffer is never saved. Such a plan runs under `runtime.apply` like eager at its predicted
peak, without rerunning the saved matmuls; a backward formula of several ops holds its inputs through all
of them (`held_reads`)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from memplan import runtime
from memplan.runtime.measure.meter import PeakMeter
from memplan.runtime.format.plan import graph_provenance
from memplan.runtime.policy.apply import capture_eager
from memplan.runtime.policy.form import FORM, PolicyFormError, Regions, decisions, held_reads, policy_schedule
from memplan.tasks.solve import solve
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import simulate
from memplan.tasks.solve.core.solution import checked_solution
from tests.runtime.projection_net import Net

A, B, C, D, LOSS, GRAD = range(6)


def chain() -> Regions:
    """Region r = a -> b -> c -> d; the loss reads d; the backward reads b and c (and the loss)."""
    return Regions(order=(A, B, C, D, LOSS, GRAD), inputs=((), (A,), (B,), (C,), (D,), (B, C, LOSS)),
                   outputs=((A,), (B,), (C,), (D,), (LOSS,), (GRAD,)), backward=frozenset({GRAD}),
                   region_of=("r",) * 4 + (None, None), random=frozenset(), allocating=frozenset(range(6)))


def test_a_save_only_the_recomputation_reads_is_allowed_and_an_idle_one_refused():
    regions = chain()
    assert regions.rerun["r"] == regions.savable["r"] == [A, B, C]     # d: after the last value read
    computes = [s["compute"] for s in policy_schedule(regions, {"r": {A}})]   # a: read by recomputed b only
    assert computes == [A, B, C, D, LOSS, B, C, GRAD]
    assert regions.idle_saves("r", {A, B}) == {A}           # b saved too: nothing reads a before its rerun
    with pytest.raises(PolicyFormError, match=r"saves nodes \[0\] that neither its backward"):
        policy_schedule(regions, {"r": {A, B}})
    assert regions.settled("r", {A, B}) == {B}
    with pytest.raises(PolicyFormError, match="cannot save nodes"):
        policy_schedule(regions, {"r": {D}})


def test_decisions_read_back_a_save_of_an_unread_value_and_refuse_an_idle_one():
    regions = chain()
    assert decisions(regions, policy_schedule(regions, {"r": {A}})) == {"r": frozenset({A})}
    only_c = [{"compute": n} for n in (A, B, C, D, LOSS, C, GRAD)]    # keeps a and b: nothing reads a again
    with pytest.raises(PolicyFormError, match="would keep nodes \\[0\\]"):
        decisions(regions, only_c)


def test_dropouts_mask_buffer_is_never_saved():
    x, buffer, draw, mask, out, grad = range(6)            # eager dropout: empty_like, bernoulli_, mul
    regions = Regions(order=tuple(range(6)), inputs=((), (x,), (buffer,), (draw,), (x, mask), (mask, out)),
                      outputs=tuple((n,) for n in range(6)), backward=frozenset({grad}),
                      region_of=("r",) * 5 + (None,), random=frozenset({draw}), allocating=frozenset(range(6)))
    assert regions.unsaved == {buffer, draw, mask}
    assert regions.savable["r"] == [x, out]


def test_an_autograd_nodes_last_op_reads_what_its_earlier_ops_read_from_outside_it():
    phases = ("forward", "backward", "backward", "backward", "backward")
    inputs = ((), (0,), (1, 0), (2, 0), (3,))            # 1 and 2: one Node (cos(x), grad * cos); 3, 4: others
    outputs = ((0,), (1,), (2,), (3,), (4,))
    assert held_reads(phases, inputs, outputs, (None, 7, 7, 8, None)) == [(), (0,), (1, 0), (2, 0), (3,)]
    assert held_reads(phases, ((), (0,), (1,), (2,), (3,)), outputs, (None, 7, 7, 7, None)) == \
        [(), (0,), (1,), (2, 0), (3,)]                   # 0 held to the Node's end; 1, 2 made inside it


class _CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func is torch.ops.aten.addmm.default
        return func(*args, **(kwargs or {}))


def _step(model, loss_fn, batch):
    model.zero_grad(set_to_none=True)
    with PeakMeter("cpu") as meter, _CountMatmuls() as count:
        loss_fn(model, *batch).backward()
    return meter.peak_bytes, count.calls, {k: p.grad.clone() for k, p in model.named_parameters()}


def test_saved_projections_are_not_rerun_and_the_peak_is_predicted():
    torch.manual_seed(0)
    model, loss_fn = Net(), lambda m, x, y: F.cross_entropy(m(x), y)
    batch = (torch.randn(256, 32), torch.randint(0, 8, (256,)))
    graph = capture_eager(model, loss_fn, batch)
    problem = Problem.from_graph(graph, {n.id: (10.0 if n.targets[0] == "aten.addmm.default" else 1.0, 0)
                                         for n in graph.nodes})
    regions = Regions.of_graph(graph)
    labels = graph.meta["autograd_nodes"]
    cos = [n.id for n in graph.nodes if n.targets[0] == "aten.cos.default"]
    assert len(cos) == 3 and all(labels[c] is not None and labels[c] == labels[c + 1] for c in cos)  # cos, mul
    matmuls = {name: {n for n in nodes if graph.nodes[n].targets[0] == "aten.addmm.default"}
               for name, nodes in regions.savable.items()}
    unread = {n for name, keep in matmuls.items() for n in keep
              if not regions.backward_reads[name] & set(graph.nodes[n].outputs)}
    assert len(unread) == 3                                           # each block's `inp`
    saved = {name: regions.settled(name, keep) for name, keep in matmuls.items()}
    assert saved == {name: frozenset(keep) for name, keep in matmuls.items()}
    schedule = policy_schedule(regions, saved)
    solution = checked_solution(problem, "hand", simulate(problem, schedule).peak_bytes, schedule, form=FORM)
    plan = solution.to_plan(problem)
    plan.provenance.update(graph_provenance(graph))
    eager_peak, eager_matmuls, eager_grads = _step(copy.deepcopy(model), loss_fn, batch)
    applied = runtime.apply(plan, copy.deepcopy(model), loss_fn, batch, graph=graph)
    peak, matmul_calls, grads = _step(applied, loss_fn, batch)
    assert matmul_calls == eager_matmuls                              # no projection reran
    for k in eager_grads:
        torch.testing.assert_close(grads[k], eager_grads[k], rtol=0, atol=1e-6)
    assert abs(peak / solution.predicted_peak_bytes - 1) <= 0.05, (peak, solution.predicted_peak_bytes)
    assert peak < eager_peak
    best = solve(problem, "selective-policy", solution.predicted_peak_bytes)   # the ladder passes this decision
    assert best.feasible and best.objective <= solution.objective + 1e-9


def test_a_region_recomputes_before_the_first_op_of_the_autograd_node_that_reads_it():
    x, y, loss, grad_in, grad_w = range(5)       # a linear's backward: grad input (reads the weight) first,
    regions = Regions(order=tuple(range(5)), inputs=((), (x,), (y,), (loss,), (loss, x)),   # then grad weight
                      outputs=tuple((n,) for n in range(5)), backward=frozenset({grad_in, grad_w}),
                      region_of=("r", "r", None, None, None), random=frozenset(), allocating=frozenset(range(5)),
                      autograd=(None, None, None, 3, 3))
    assert regions.trigger("r") == grad_in       # one Node: it unpacks x as it starts
    assert dataclasses.replace(regions, autograd=()).trigger("r") == grad_w


def test_backward_calls_align_with_the_graph_past_ops_only_one_side_has():
    from memplan.runtime.tracing.autograd_nodes import match_nodes

    graph_ops = [("mul", 0), ("pow", 1), ("mul", 1), ("div", 1), ("sum", 2), ("mul", 2), ("add", 3), ("mm", 4),
                 ("mm", 4)]
    calls = [("mul", 10), ("detach", 11), ("add", 13), ("mm", 14), ("mm", 14)]   # eager ran nodes 1, 2 otherwise
    assert match_nodes(graph_ops, calls) == {0: 10, 3: 13, 4: 14}


def test_an_eager_matmuls_unsafe_view_neither_skips_graph_ops_nor_saves_them():
    """Eager attention's `attn @ v` is bmm then `_unsafe_view`; the traced graph has the bmm alone, then the
    output projection (clone, mm, `_unsafe_view`) and the residual add. Matching the eager `_unsafe_view`
    to the projection's would skip the clone and mm and give them the saved add's MUST_SAVE (Llama: 1 MiB
    a layer above the prediction). `_unsafe_view` allocates nothing: a view on both sides."""
    from torch.utils.checkpoint import CheckpointPolicy
    from memplan.runtime.tracing.ops import is_view
    from memplan.runtime.policy.apply import _Matcher

    aten = torch.ops.aten
    graph_ops = [(aten.bmm.default, 93), (aten.clone.default, 94), (aten.mm.default, 95),
                 (aten._unsafe_view.default, 95), (aten.add.Tensor, 96)]
    matcher = _Matcher([(op, n) for op, n in graph_ops if not is_view(op)], frozenset({96}))    # as region_ops
    eager = [aten.bmm.default, aten._unsafe_view.default, aten.transpose.int, aten.clone.default, aten.view.default,
             aten.t.default, aten.mm.default, aten._unsafe_view.default, aten.add.Tensor]
    saved = [op for op in eager if matcher.decide(op) is CheckpointPolicy.MUST_SAVE]
    assert saved == [aten.add.Tensor] and matcher.at == len(matcher.ops)
