"""Executor: plans (default and recomputing) train exactly like eager PyTorch; memory matches the model."""

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from memplan import runtime
from memplan.runtime.format.plan import Plan, PlanError

MODELS = ["mlp", "resnet18", "vgg11", "mobilenet_v2", "small_densenet", "gpt2"]
CNNS = ["resnet18", "vgg11", "mobilenet_v2"]   # for the peak tests
_EAGER = {}


@pytest.fixture(scope="module")
def eager(captured, helpers):
    """`eager(name)`: one eager step (loss, gradients, buffers, RNG state, measured peak), cached."""
    def get(name):
        if name not in _EAGER:
            model, loss_fn, batch, _ = captured(name)
            _EAGER[name] = helpers.train_eager(model, loss_fn, batch)
        return _EAGER[name]
    return get


def sqrt_n_plan(graph, helpers):
    return Plan(graph.fingerprint, helpers.recompute_schedule(graph, helpers.chen_sqrt_n_drop(graph)))


@pytest.mark.parametrize("name", MODELS)
def test_default_plan_trains_like_eager(captured, eager, helpers, name):
    model, loss_fn, batch, g = captured(name)
    result = helpers.train_plan(model, loss_fn, batch, runtime.default_plan(g), graph=g)
    helpers.assert_same_step(eager(name), result)
    assert torch.equal(eager(name).rng, result.rng)       # the generator ends where eager leaves it
    helpers.assert_peak_matches(result.peak, helpers.simulated_peak(g, runtime.default_plan(g).schedule))


@pytest.mark.parametrize("name", MODELS)
def test_recomputation_plan_trains_like_eager(captured, eager, helpers, name):
    model, loss_fn, batch, g = captured(name)
    plan = sqrt_n_plan(g, helpers)
    assert len(plan.compute_steps()) > len(g.nodes)       # it does recompute
    result = helpers.train_plan(model, loss_fn, batch, plan, graph=g)
    helpers.assert_same_step(eager(name), result)
    assert torch.equal(eager(name).rng, result.rng)
    helpers.assert_peak_matches(result.peak, helpers.simulated_peak(g, plan.schedule))


@pytest.mark.parametrize("name", CNNS)
def test_default_plan_peak_is_within_two_percent_of_eager(captured, eager, helpers, name):
    if helpers.device.type == "cuda":
        pytest.skip("a CPU criterion: on CUDA eager batch norm is cuDNN's, which saves other tensors than ATen's")
    model, loss_fn, batch, g = captured(name)
    result = helpers.train_plan(model, loss_fn, batch, runtime.default_plan(g), graph=g)
    assert abs(result.peak / eager(name).peak - 1) <= 0.02, (result.peak, eager(name).peak)


@pytest.mark.parametrize("name", ["mobilenet_v2", "gpt2"])
def test_checkpointing_lowers_the_measured_peak(captured, helpers, name):
    model, loss_fn, batch, g = captured(name)
    default = helpers.train_plan(model, loss_fn, batch, runtime.default_plan(g), graph=g)
    recompute = helpers.train_plan(model, loss_fn, batch, sqrt_n_plan(g, helpers), graph=g)
    assert recompute.peak < 0.9 * default.peak, (recompute.peak, default.peak)


def test_recomputed_code_is_straight_line(captured, helpers):
    model, loss_fn, batch, g = captured("mlp")
    plan = Plan(g.fingerprint, helpers.recompute_schedule(g, {n.id for n in g.nodes if n.phase != "backward"}))
    step = runtime.load(plan, copy.deepcopy(model), loss_fn, graph=g)
    code = step.compile(*batch).fn.code
    assert "for " not in code and "while " not in code
    op_calls = sum(1 for n in plan.compute_steps() for m in g.program.groups[n]
                   if isinstance(m.target, torch._ops.OpOverload))
    assert code.count("torch.ops.") == op_calls     # one line per op call, recomputations repeated
    draw, = (n for n in g.nodes if n.id in g.program.random_devices)    # the dropout's (its mask's on CPU)
    assert code.count(f"{draw.targets[0]}(") == plan.compute_steps().count(draw.id) == 2


def test_plan_file_three_steps_with_lazy_capture_match_eager(captured, tmp_path):
    """The README flow: load a plan file, train three steps with an optimizer."""
    model, loss_fn, batch, g = captured("mlp")
    runtime.default_plan(g).save(tmp_path / "mlp.plan.json")

    def train(use_plan):
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        step = runtime.load(tmp_path / "mlp.plan.json", m, loss_fn) if use_plan else None
        torch.manual_seed(3)
        losses = []
        for _ in range(3):
            opt.zero_grad()
            if use_plan:
                loss = step(*batch)
            else:
                loss = loss_fn(m, *batch)
                loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, m.state_dict()

    (eager_losses, eager_state), (plan_losses, plan_state) = train(False), train(True)
    assert plan_losses == pytest.approx(eager_losses, rel=1e-5)
    assert len(set(plan_losses)) == 3                     # it really trained
    for k in eager_state:
        torch.testing.assert_close(plan_state[k], eager_state[k], rtol=1e-4, atol=1e-5)


def test_gradients_accumulate_and_buffers_update_in_place(captured):
    model, loss_fn, batch, g = captured("mlp")
    eager_model, plan_model = copy.deepcopy(model), copy.deepcopy(model)
    buffers = [b for b in plan_model.buffers()]
    step = runtime.load(runtime.default_plan(g), plan_model, loss_fn, graph=g)
    for seed in (5, 6):
        torch.manual_seed(seed)
        loss_fn(eager_model, *batch).backward()
        torch.manual_seed(seed)
        step(*batch)
    assert [b for b in plan_model.buffers()] == buffers and all(x is y for x, y in zip(plan_model.buffers(), buffers))
    assert plan_model.bn.num_batches_tracked.item() == 2
    for (k, p), q in zip(eager_model.named_parameters(), plan_model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=k)
    for (k, b), c in zip(eager_model.named_buffers(), plan_model.buffers()):
        torch.testing.assert_close(c, b, rtol=1e-4, atol=1e-5, msg=k)


def test_compiled_program_is_reused_for_the_same_shapes(captured):
    model, loss_fn, batch, g = captured("mlp")
    step = runtime.load(runtime.default_plan(g), copy.deepcopy(model), loss_fn, graph=g)
    first = step.compile(*batch)
    step(*batch)
    step(*[t.clone() for t in batch])
    assert step.compile(*batch) is first and len(step.code) == 1


def test_plan_for_another_shape_is_refused_naming_both_fingerprints(captured):
    model, loss_fn, (x, y), g = captured("mlp")
    step = runtime.load(runtime.default_plan(g), copy.deepcopy(model), loss_fn)
    with pytest.raises(PlanError) as err:
        step(x[:4], y[:4])
    other = runtime.capture(model, loss_fn, (x[:4], y[:4])).fingerprint
    assert g.fingerprint in str(err.value) and other in str(err.value)


def test_plan_for_another_model_is_refused(captured):
    model, loss_fn, batch, g = captured("mlp")
    _, _, _, gpt = captured("gpt2")
    step = runtime.load(runtime.default_plan(gpt), copy.deepcopy(model), loss_fn, graph=g)
    with pytest.raises(PlanError, match=f"plan fingerprint {gpt.fingerprint} does not match .*{g.fingerprint}"):
        step(*batch)


def test_graph_of_another_model_is_refused(captured):
    model, loss_fn, batch, g = captured("mlp")
    other = copy.deepcopy(model)
    other.l2 = torch.nn.Linear(16, 16, bias=False)
    step = runtime.load(runtime.default_plan(g), other, loss_fn, graph=g)
    with pytest.raises(ValueError, match="param 'l2.bias' .* captured from another model"):
        step(*batch)


def test_invalid_plan_is_refused_before_running(captured):
    model, loss_fn, batch, g = captured("mlp")
    schedule = runtime.default_plan(g).schedule
    plan = Plan(g.fingerprint, schedule[1:])                  # node 0's output is never computed
    model = copy.deepcopy(model)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(PlanError, match="has not been computed"):
        runtime.load(plan, model, loss_fn, graph=g)(*batch)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(drop_bits=st.lists(st.booleans(), min_size=64, max_size=64), rng=st.randoms(use_true_random=False),
       extra=st.sampled_from([0.0, 0.2, 0.6]))
def test_random_recomputation_schedules_train_like_eager(captured, eager, helpers, drop_bits, rng, extra):
    model, loss_fn, batch, g = captured("mlp")
    forward = [n.id for n in g.nodes if n.phase != "backward"]
    drop = {n for n, bit in zip(forward, drop_bits) if bit}
    plan = Plan(g.fingerprint, helpers.recompute_schedule(g, drop, rng, extra))
    result = helpers.train_plan(model, loss_fn, batch, plan, graph=g)
    helpers.assert_same_step(eager("mlp"), result)
    assert torch.equal(eager("mlp").rng, result.rng)
    helpers.assert_peak_matches(result.peak, helpers.simulated_peak(g, plan.schedule))


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rng=st.randoms(use_true_random=False))
def test_random_recomputation_of_gpt2_dropouts_trains_like_eager(captured, eager, helpers, rng):
    model, loss_fn, batch, g = captured("gpt2")
    forward = [n.id for n in g.nodes if n.phase != "backward"]
    drop = {n for n in forward if rng.random() < 0.5}
    plan = Plan(g.fingerprint, helpers.recompute_schedule(g, drop, rng, 0.1))
    result = helpers.train_plan(model, loss_fn, batch, plan, graph=g)
    helpers.assert_same_step(eager("gpt2"), result)
