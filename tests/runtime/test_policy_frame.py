"""Checkpoint's frame holds a region's inputs (runtime/policy/form.py, `Regions.frame_inputs`): non-reentrant
`torch.utils.checkpoint` keeps the values a region was called with until the last autograd Node saving a
tensor under it has run, so an input only the regions' forwards read (Llama's 4-D attention mask) lives
through the region's backward. The policy form's schedule says so with `holds`, which the one simulator
counts and plans carry."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memplan import runtime
from memplan.runtime.measure.meter import PeakMeter
from memplan.runtime.format.plan import Plan, graph_provenance
from memplan.runtime.policy.apply import capture_eager
from memplan.runtime.policy.form import FORM, PolicyFormError, Regions, decisions, policy_schedule
from memplan.tasks.solve import solve
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import simulate
from memplan.tasks.solve.core.solution import checked_solution


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.inp, self.out = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x, bias):
        return x + self.out(torch.sin(self.inp(x) + bias))       # add's backward keeps nothing of `bias`


class MaskedNet(nn.Module):
    """`bias` is made once, outside the blocks, and read only by their forwards, as Llama's attention mask."""

    def __init__(self, d: int = 64):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(3))
        self.head = nn.Linear(d, 8)

    def forward(self, x):
        bias = torch.where(x.repeat(1, 2) > 0, 0.0, -1.0)
        for block in self.blocks:
            x = block(x, bias)
        return self.head(x)


def _measured(model, loss_fn, batch):
    model.zero_grad(set_to_none=True)
    with PeakMeter("cpu") as meter:
        loss_fn(model, *batch).backward()
    return meter.peak_bytes, {k: p.grad.clone() for k, p in model.named_parameters()}


def test_a_checkpointed_regions_outside_input_is_held_through_its_backward_as_predicted(tmp_path):
    torch.manual_seed(0)
    model, loss_fn = MaskedNet(), lambda m, x, y: F.cross_entropy(m(x), y)
    batch = (torch.randn(64, 64), torch.randint(0, 8, (64,)))
    graph = capture_eager(model, loss_fn, batch)
    problem = Problem.from_graph(graph, {n.id: (1.0, 0) for n in graph.nodes})
    regions = Regions.of_graph(graph)
    bias = next(v for n in graph.nodes if n.targets[0] == "aten.where.self" for v in n.outputs)
    assert all(bias in regions.frame_inputs[name] for name in regions.members)
    whole = {name: frozenset() for name in regions.members}
    schedule = policy_schedule(regions, whole)
    solution = checked_solution(problem, "hand", simulate(problem, schedule).peak_bytes, schedule, form=FORM)
    plan = solution.to_plan(problem)
    plan.provenance.update(graph_provenance(graph))
    plan.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    assert loaded.schedule == plan.schedule and any("holds" in s for s in loaded.schedule)
    assert decisions(regions, loaded.schedule) == whole

    _measured(copy.deepcopy(model), loss_fn, batch)                  # one-time buffers
    _, eager_grads = _measured(copy.deepcopy(model), loss_fn, batch)
    applied = runtime.apply(loaded, copy.deepcopy(model), loss_fn, batch, graph=graph)
    peak, grads = _measured(applied, loss_fn, batch)
    for k in eager_grads:
        torch.testing.assert_close(grads[k], eager_grads[k], rtol=0, atol=1e-6)
    bias_bytes = graph.values[bias].bytes
    assert abs(peak - solution.predicted_peak_bytes) < bias_bytes / 4, (peak, solution.predicted_peak_bytes)
    unheld = [{"compute": s["compute"]} for s in schedule]
    assert simulate(problem, unheld).peak_bytes <= solution.predicted_peak_bytes - bias_bytes   # the frame's share

    found = solve(problem, "selective-policy", solution.predicted_peak_bytes)    # the search counts the holds
    assert found.feasible and found.predicted_peak_bytes <= solution.predicted_peak_bytes
    assert found.predicted_peak_bytes == simulate(problem, found.schedule).peak_bytes


X, MASK, A, B, LOSS, GRAD_B, GRAD_A, GRAD_X = range(8)


def _two_op_region() -> Regions:
    """Region r: a = f(x, mask), b = g(a); the loss reads b. Backward: grad_b reads a (r's own value), grad_a
    reads x (r's input, as a linear's weight gradient), grad_x reads nothing of the forward."""
    return Regions(order=tuple(range(8)),
                   inputs=((), (), (X, MASK), (A,), (B,), (LOSS, A), (GRAD_B, X), (GRAD_A,)),
                   outputs=((X,), (MASK,), (A,), (B,), (LOSS,), (GRAD_B,), (GRAD_A,), (GRAD_X,)),
                   backward=frozenset({GRAD_B, GRAD_A, GRAD_X}),
                   region_of=(None, None, "r", "r", None, None, None, None),
                   random=frozenset(), allocating=frozenset(range(8)))


def test_the_frame_ends_with_the_last_backward_node_reading_what_the_region_saved_or_was_called_with():
    regions = _two_op_region()
    assert regions.frame_inputs == {"r": (X, MASK)}
    assert regions.frame_ends == {"r": GRAD_A}                # grad_x reads nothing the region saved
    steps = policy_schedule(regions, {"r": frozenset()})
    assert steps == [{"compute": n} for n in (X, MASK, A, B, LOSS, A)] + \
        [{"compute": GRAD_B}, {"compute": GRAD_A, "holds": [X, MASK]}, {"compute": GRAD_X}]
    assert policy_schedule(regions, {}) == [{"compute": n} for n in range(8)]    # not checkpointed: no frame


def test_a_policy_plan_must_hold_what_the_frame_holds():
    regions = _two_op_region()
    steps = policy_schedule(regions, {"r": frozenset()})
    without = [{"compute": s["compute"]} for s in steps]
    with pytest.raises(PolicyFormError, match=r"compute step 7 \(node 6\) holds values \[\] where the policy form "
                                              r"holds \[0, 1\]"):
        decisions(regions, without)


def test_a_read_of_a_shared_input_belongs_to_the_region_whose_backward_runs_then():
    """r1 and r2 both read `mask`, as every Llama layer reads the attention mask: a backward node reading it
    after r1's backward has begun ends r1's frame, not r2's."""
    x, mask, a1, b1, a2, b2, loss, g2, g2x, g1, g1x = range(11)
    regions = Regions(order=tuple(range(11)),
                      inputs=((), (), (x, mask), (a1,), (b1, mask), (a2,), (b2,), (loss, a2), (g2, mask), (g2x, a1),
                              (g1, mask)),
                      outputs=tuple((n,) for n in range(11)), backward=frozenset({g2, g2x, g1, g1x}),
                      region_of=(None, None, "r1", "r1", "r2", "r2", None, None, None, None, None),
                      random=frozenset(), allocating=frozenset(range(11)))
    assert regions.frame_inputs == {"r1": (x, mask), "r2": (mask, b1)}
    assert regions.frame_ends == {"r2": g2x, "r1": g1x}
