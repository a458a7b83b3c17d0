"""Arena mode: value copies at greedy addresses train exactly like eager PyTorch, and the measured peak is
the simulated arena peak of the copies actually placed (the fallback copies allocated as usual)."""

import copy
import warnings

import pytest
import torch

from memplan import runtime
from memplan.runtime.execute.arena import ArenaFallbackWarning, out_overload
from memplan.runtime.measure.meter import PeakMeter
from memplan.runtime.format.plan import Plan
from memplan.tasks.solve.core.addresses import greedy_addresses
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import simulate

aten = torch.ops.aten


def train_arena(model, loss_fn, batch, plan, graph):
    """One step in arena mode on a copy of `model`: (loss, model, report, measured peak, warnings)."""
    model = copy.deepcopy(model)
    step = runtime.load(plan, model, loss_fn, graph=graph, arena=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step.compile(*batch)
    torch.manual_seed(1)
    with PeakMeter(batch[0].device) as meter:
        loss = step(*batch)
    (report,) = step.arena_report.values()
    return loss, model, report, meter.peak_bytes, [w for w in caught if w.category is ArenaFallbackWarning]


@pytest.mark.parametrize("name", ["resnet18", "gpt2"])
@pytest.mark.parametrize("recompute", [False, True], ids=["default", "sqrt_n"])
def test_arena_plan_trains_like_eager_at_the_simulated_arena_peak(captured, helpers, name, recompute):
    model, loss_fn, batch, g = captured(name)
    schedule = helpers.recompute_schedule(g, helpers.chen_sqrt_n_drop(g)) if recompute else \
        runtime.default_plan(g).schedule
    problem = Problem.from_graph(g)
    addresses = greedy_addresses(problem, simulate(problem, schedule))
    loss, trained, report, peak, caught = train_arena(model, loss_fn, batch, Plan(g.fingerprint, schedule, addresses), g)

    eager = helpers.train_eager(model, loss_fn, batch)
    assert torch.equal(loss, eager.loss)
    for k, p in trained.named_parameters():
        assert torch.equal(p.grad, eager.grads[k]), k
        assert p.grad.untyped_storage().nbytes() == p.grad.numel() * p.grad.element_size()   # not in the arena
    for k, b in trained.named_buffers():
        assert torch.equal(b, eager.buffers[k]), k

    assert len(caught) == 1 and "aten." in str(caught[0].message)
    assert report.fallback and report.placed > 0
    assert report.bytes_not_placed == sum(nbytes for *_, nbytes, _ in report.fallback) == \
        sum(g.values[v].bytes for _, v, _, _ in report.fallback) > 0
    fallback = {(step, value) for step, value, _, _ in report.fallback}
    placed = {copy_: offset for copy_, offset in addresses.items() if copy_ not in fallback}
    assert len(placed) == report.placed
    predicted = simulate(problem, schedule, placed)
    assert report.arena_bytes == predicted.arena_bytes
    helpers.assert_peak_matches(peak, predicted.arena_peak_bytes)


def test_out_overloads_are_found_by_schema():
    assert out_overload(aten.threshold_backward.default)[:2] == (aten.threshold_backward.grad_input, ("grad_input",))
    assert out_overload(aten.nll_loss_forward.default)[:2] == (aten.nll_loss_forward.output, ("output", "total_weight"))
    assert out_overload(aten.mm.default, "CUDA")[0] is aten.mm.out
    # ATen's generated out= (functional result into a temporary, then a copy) does not count
    assert out_overload(aten.convolution.default) is None and out_overload(aten.clone.default) is None
    assert out_overload(aten.native_batch_norm.default)[1] == ("out", "save_mean", "save_invstd")
    assert out_overload(aten.ones.default) == (aten.ones.out, ("out",), ("dtype", "layout", "device", "pin_memory"))
    assert out_overload(aten._native_batch_norm_legit_functional.default) is None


def test_arena_needs_a_plan_with_addresses_and_is_allocated_once(captured):
    model, loss_fn, batch, g = captured("mlp")
    with pytest.raises(ValueError, match="arena=True needs a plan with addresses"):
        runtime.load(runtime.default_plan(g), model, loss_fn, graph=g, arena=True)
    problem = Problem.from_graph(g)
    schedule = runtime.default_plan(g).schedule
    plan = Plan(g.fingerprint, schedule, greedy_addresses(problem, simulate(problem, schedule)))
    step = runtime.load(plan, copy.deepcopy(model), loss_fn, graph=g, arena=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ArenaFallbackWarning)
        code = step.compile(*batch).fn.code
    assert code.count("new_arena(") == 1 and code.count("keep_alive(") == 1
    assert "torch.ops.aten.mm.out(" in code or "torch.ops.aten.addmm.out(" in code
    plain = runtime.load(plan, copy.deepcopy(model), loss_fn, graph=g).compile(*batch).fn.code
    assert "new_arena" not in plain                           # without arena=True addresses are ignored


@pytest.mark.parametrize("name", ["resnet18", "gpt2"])
def test_addresses_for_in_place_nodes_only_leave_nothing_outside_the_arena(captured, helpers, name):
    """Placing only the copies of `in_place_nodes` (what the solve stage does): no fallback, no warning, and
    the arena is the placed copies' extent, at least their live peak."""
    import numpy as np

    from memplan.runtime.execute.arena import in_place_nodes

    model, loss_fn, batch, g = captured(name)
    schedule = runtime.default_plan(g).schedule
    problem = Problem.from_graph(g)
    nodes = in_place_nodes(g, str(helpers.device))
    assert nodes and len(nodes) < len(g.nodes)
    sim = simulate(problem, schedule)
    addresses = greedy_addresses(problem, sim, np.array([s["compute"] in nodes for s in schedule]))
    loss, trained, report, peak, caught = train_arena(model, loss_fn, batch, Plan(g.fingerprint, schedule, addresses), g)
    assert not caught and report.fallback == [] and report.placed == len(addresses)
    predicted = simulate(problem, schedule, addresses)
    assert report.arena_bytes == predicted.arena_bytes
    helpers.assert_peak_matches(peak, predicted.arena_peak_bytes)
    eager = helpers.train_eager(model, loss_fn, batch)
    assert torch.equal(loss, eager.loss) and all(torch.equal(p.grad, eager.grads[k]) for k, p in trained.named_parameters())
