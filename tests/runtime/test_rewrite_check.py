"""Capture's rewrites checked on the device that runs them (runtime/tracing/rewrite_check.py): exact instances are
applied, inexact ones keep the op they would replace, and the selection travels with the plan."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memplan import runtime
import memplan.runtime.tracing.capture as capture_module
import memplan.runtime.tracing.rewrite_check as rewrite_check
from memplan.runtime.format.plan import PlanError
from memplan.runtime.tracing.rewrites import PASSES, _fake_call


class _SmallCNN(nn.Module):
    """A 3x3 convolution, a pointwise one (float64: ATen's GEMM path at any thread count) and a linear head."""

    def __init__(self):
        super().__init__()
        self.stem, self.mix = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 1)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(F.relu(self.mix(F.relu(self.stem(x)))).mean((2, 3)))


def _cnn():
    torch.manual_seed(0)
    model = _SmallCNN().double()
    batch = (torch.randn(3, 3, 9, 9, dtype=torch.float64), torch.randint(0, 4, (3,)))
    return model, lambda m, x, y: F.cross_entropy(m(x), y), batch


def _build(helpers, name):
    return _cnn() if name == "cnn" else helpers.build(name)


@pytest.mark.parametrize("name, passes", [
    ("cnn", {"split_convolution_backward", "pointwise_input_gradient", "fuse_cross_entropy"}),
    # GPT-2's head and loss is also a candidate of the chunked loss, which by default applies to larger logits
    ("gpt2", {"chunk_cross_entropy", "fuse_cross_entropy", "fuse_tanh_gelu", "split_dropout"})])
def test_the_rewrites_check_exact_on_this_cpu_and_the_graph_trains_bit_for_bit(helpers, name, passes):
    """Verified capture applies every default instance (each checked on the step's real values, dropout's
    from the same generator state) and the graph trains like eager to the bit."""
    model, loss_fn, batch = _build(helpers, name)
    if helpers.device.type != "cpu":
        pytest.skip("the passes of these models are CPU-graph rewrites")
    default = runtime.capture(model, loss_fn, batch, verify=False).meta["rewrites"]     # unchecked
    g = runtime.capture(model, loss_fn, batch)                                         # verified: the default
    record = g.meta["rewrites"]
    assert {p for p, found in record["found"].items() if found} == passes
    for name_, instances in default["applied"].items():     # each default instance: applied, or found inexact here
        assert sorted(record["applied"][name_] + record["inexact"].get(name_, [])) == sorted(instances), name_
    assert record["verified_on"]["threads"] == torch.get_num_threads()
    helpers.train_like_eager_bitwise(model, loss_fn, batch, g)


def _ulp_up(graph, rw, on_cpu):
    """A wrong rewrite: each ReLU's output one ulp up (`nextafter(y, inf)`)."""
    aten = torch.ops.aten
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target is not aten.relu.default or not rw.take():
            continue
        with graph.inserting_after(n):
            inf = graph.call_function(aten.full_like.default, (n, float("inf")))
        with graph.inserting_after(inf):
            up = graph.call_function(aten.nextafter.default, (n, inf))
        for node in (inf, up):
            node.meta = {"val": _fake_call(node, n.meta["val"])}
        n.replace_all_uses_with(up, delete_user_cb=lambda user: user not in (inf, up))
        rw.done([(n, up)])


def test_a_rewrite_one_ulp_off_is_found_inexact_and_not_applied(helpers, monkeypatch):
    model, loss_fn, batch = _cnn()
    monkeypatch.setattr(capture_module, "PASSES", [*PASSES, ("ulp_up", _ulp_up)])
    g = runtime.capture(model, loss_fn, batch, verify=True)
    record = g.meta["rewrites"]
    assert record["found"]["ulp_up"] == 2 and record["inexact"]["ulp_up"] == [0, 1]
    assert record["applied"]["ulp_up"] == []
    assert not any("nextafter" in t for n in g.nodes for t in n.targets)
    assert runtime.capture(model, loss_fn, batch).meta["rewrites"] == record     # verify is the default
    unchecked = runtime.capture(model, loss_fn, batch, verify=False)   # unchecked, it applies: the check found it
    assert unchecked.meta["rewrites"]["applied"]["ulp_up"] == [0, 1]
    assert any("nextafter" in t for n in unchecked.nodes for t in n.targets)
    helpers.train_like_eager_bitwise(model, loss_fn, batch, g)


def test_a_pass_inexact_on_this_device_keeps_the_joint_op_and_its_plan_trains_like_eager(helpers, monkeypatch):
    """The convolution split reported inexact: every convolution backward stays one joint node (so the
    pointwise product has no candidate); the plan records that selection and `runtime.load`, capturing
    again with it, trains bit for bit like eager."""
    real = rewrite_check.instance_exact
    monkeypatch.setattr(rewrite_check, "instance_exact", lambda name, index, replaced, results:
                        name != "split_convolution_backward" and real(name, index, replaced, results))
    model, loss_fn, batch = _cnn()
    g = runtime.capture(model, loss_fn, batch, verify=True)
    record = g.meta["rewrites"]
    assert record["inexact"]["split_convolution_backward"] == [0]      # the stem has no input gradient
    assert record["applied"]["split_convolution_backward"] == [] and record["found"]["pointwise_input_gradient"] == 0
    assert record["applied"]["fuse_cross_entropy"] == [0]
    backward = [n for n in g.nodes if n.phase == "backward"]
    assert not any(n.targets[0] in ("aten.convolution.default", "aten.bmm.default") for n in backward)
    joint = [n for n in backward if n.targets[0] == "aten.convolution_backward.default" and len(n.outputs) == 3]
    assert len(joint) == 1                                   # the mix's input, weight and bias gradients
    plan = runtime.default_plan(g)
    assert plan.rewrites == record["applied"] and plan.provenance["rewrites"]["inexact"] == record["inexact"]
    monkeypatch.setattr(rewrite_check, "instance_exact", real)
    eager = helpers.train_eager(model, loss_fn, batch)
    planned = helpers.train_plan(model, loss_fn, batch, runtime.Plan.load(plan.to_json()))   # captures again
    assert torch.equal(eager.loss, planned.loss)
    assert all(torch.equal(eager.grads[k], planned.grads[k]) for k in eager.grads)


class _Pointwise(nn.Module):
    """A 3x3 convolution, then a pointwise one: float32 below 16 images, ATen's GEMM path on one thread only."""

    def __init__(self):
        super().__init__()
        self.stem, self.mix = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 4, 1)

    def forward(self, x):
        return self.mix(F.relu(self.stem(x))).mean((2, 3))


def _at_threads(threads, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def test_a_recorded_selection_makes_the_graph_independent_of_the_thread_count(helpers):
    """Unchecked capture takes the pointwise product at 1 thread only; with a recorded selection both thread
    counts give one fingerprint, and a plan made at 2 threads loads and trains at 1 thread. A plan that
    records no selection is refused with the thread count named."""
    torch.manual_seed(0)
    model, batch = _Pointwise(), (torch.randn(3, 3, 9, 9), torch.randint(0, 4, (3,)))
    loss_fn = lambda m, x, y: F.cross_entropy(m(x), y)  # noqa: E731
    one = _at_threads(1, lambda: runtime.capture(model, loss_fn, batch, verify=False))
    two = _at_threads(2, lambda: runtime.capture(model, loss_fn, batch, verify=True))
    assert one.meta["rewrites"]["applied"]["pointwise_input_gradient"] == [0]
    assert two.meta["rewrites"]["applied"]["pointwise_input_gradient"] == []
    assert one.fingerprint != two.fingerprint
    for threads, graph in [(1, two), (2, one)]:
        again = _at_threads(threads, lambda: runtime.capture(model, loss_fn, batch,
                                                             rewrites=graph.meta["rewrites"]["applied"]))
        assert again.fingerprint == graph.fingerprint

    plan = runtime.default_plan(two)
    eager = _at_threads(1, lambda: helpers.train_eager(model, loss_fn, batch))
    planned = _at_threads(1, lambda: helpers.train_plan(model, loss_fn, batch, plan))
    helpers.assert_same_step(eager, planned)
    unrecorded = runtime.Plan(two.fingerprint, plan.schedule)
    with pytest.raises(PlanError, match="records no rewrite selection.*thread count"):
        _at_threads(1, lambda: helpers.train_plan(model, loss_fn, batch, unrecorded))


def test_a_refused_plan_says_which_batch_it_was_made_for(helpers):
    model, loss_fn, batch = _cnn()
    plan = runtime.default_plan(runtime.capture(model, loss_fn, batch))
    with pytest.raises(PlanError, match=r"made for the batch \[3, 3, 9, 9\] float64.*this step's batch is "
                                        r"\[2, 3, 9, 9\] float64"):
        helpers.train_plan(model, loss_fn, tuple(t[:2] for t in batch), plan)
