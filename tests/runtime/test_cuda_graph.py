"""`runtime.load(..., cuda_graph=True)`: steps replayed as one CUDA graph train like eager PyTorch, step after
step, with an optimizer between steps, gradient accumulation and parameters that move; plans it cannot
replay and models off the GPU get clear errors. The GPU tests run with MEMPLAN_TEST_DEVICE=cuda."""

import copy
import os
from types import SimpleNamespace

import pytest
import torch

from memplan import runtime
from memplan.runtime.measure.exact import exact_fp32
from memplan.runtime.execute.executor import replayed_random_nodes
from memplan.runtime.format.plan import Plan

on_gpu = pytest.mark.skipif(torch.device(os.environ.get("MEMPLAN_TEST_DEVICE", "cpu")).type != "cuda",
                            reason="CUDA graphs need MEMPLAN_TEST_DEVICE=cuda")


def batches(batch):
    """Three batches: the captured one, its rows rolled (a new batch of the same shape), the first again."""
    return [batch, tuple(t.roll(1, 0) for t in batch), batch]


def train(model, steps, step_fn, *, zero_grad=True, device):
    """Per step (seeded): loss, gradients and buffers after it; SGD updates the parameters in place between
    steps. Without `zero_grad` the gradients accumulate."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = []
    for i, batch in enumerate(steps):
        torch.manual_seed(10 + i)
        with exact_fp32(str(device)):
            loss = step_fn(batch)
        out.append(SimpleNamespace(loss=loss, grads={k: p.grad.clone() for k, p in model.named_parameters()},
                                   buffers={k: b.clone() for k, b in model.named_buffers()}))
        if zero_grad:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return out


def eager_steps(model, loss_fn, steps, **kw):
    model = copy.deepcopy(model)
    return train(model, steps, lambda b: _eager(model, loss_fn, b), **kw)


def _eager(model, loss_fn, batch):
    loss = loss_fn(model, *batch)
    loss.backward()
    return loss.detach()


def graphed_steps(model, loss_fn, plan, graph, steps, **kw):
    model = copy.deepcopy(model)
    step = runtime.load(plan, model, loss_fn, graph=graph, cuda_graph=True)
    return train(model, steps, lambda b: step(*b), **kw), step


def assert_same_steps(helpers, want, got):
    for a, b in zip(want, got, strict=True):
        helpers.assert_same_step(a, b)


@on_gpu
@pytest.mark.parametrize("name", ["mlp", "resnet18", "gpt2"])
def test_graph_replays_train_like_eager_step_after_step(captured, helpers, name):
    model, loss_fn, batch, g = captured(name)
    steps = batches(batch)
    got, step = graphed_steps(model, loss_fn, runtime.default_plan(g), g, steps, device=helpers.device)
    # the losses are compared after the last step: each returned loss is its own copy, not the graph's output
    assert_same_steps(helpers, eager_steps(model, loss_fn, steps, device=helpers.device), got)
    assert step.compile(*batch).graphed.captures == 1          # captured once, replayed for every step


@on_gpu
def test_graph_of_a_recomputing_plan_trains_like_eager(captured, helpers):
    model, loss_fn, batch, g = captured("resnet18")
    plan = Plan(g.fingerprint, helpers.recompute_schedule(g, helpers.chen_sqrt_n_drop(g)))
    assert len(plan.compute_steps()) > len(g.nodes)
    steps = batches(batch)
    got, _ = graphed_steps(model, loss_fn, plan, g, steps, device=helpers.device)
    assert_same_steps(helpers, eager_steps(model, loss_fn, steps, device=helpers.device), got)


@on_gpu
def test_gradients_accumulate_across_replays(captured, helpers):
    model, loss_fn, batch, g = captured("mlp")
    steps = batches(batch)
    got, _ = graphed_steps(model, loss_fn, runtime.default_plan(g), g, steps, zero_grad=False, device=helpers.device)
    assert_same_steps(helpers, eager_steps(model, loss_fn, steps, zero_grad=False, device=helpers.device), got)


@on_gpu
def test_moved_parameters_are_captured_again(captured, helpers):
    model, loss_fn, batch, g = captured("mlp")
    moved = copy.deepcopy(model)
    step = runtime.load(runtime.default_plan(g), moved, loss_fn, graph=g, cuda_graph=True)

    def step_fn(b):
        for p in moved.parameters():                            # new storage for every parameter
            p.data = p.data.clone()
        return step(*b)

    got = train(moved, batches(batch), step_fn, device=helpers.device)
    assert_same_steps(helpers, eager_steps(model, loss_fn, batches(batch), device=helpers.device), got)
    assert step.compile(*batch).graphed.captures == 3


@on_gpu
def test_a_plan_recomputing_dropout_is_refused(captured, helpers):
    model, loss_fn, batch, g = captured("mlp")
    plan = Plan(g.fingerprint, helpers.recompute_schedule(g, set(g.program.random_devices)))
    assert replayed_random_nodes(plan, g.program)
    step = runtime.load(plan, copy.deepcopy(model), loss_fn, graph=g, cuda_graph=True)
    with pytest.raises(ValueError, match="recomputes random operator node"):
        step(*batch)


def test_a_model_off_the_gpu_is_refused(captured):
    model, loss_fn, batch, g = captured("mlp")
    cpu_model = copy.deepcopy(model).cpu()
    with pytest.raises(ValueError, match=r"cuda_graph=True .* on cpu\. Move the model to a GPU"):
        runtime.load(runtime.default_plan(g), cpu_model, loss_fn, cuda_graph=True)
