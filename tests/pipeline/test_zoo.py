"""The model zoo (issue #53): one small model per family, each built from its `[[models]]` entry (`ModelConfig`),
planned by `memplan.plan` (trace, profile, dtr at 10% overhead, validation against eager PyTorch), then trained three
SGD steps with `memplan.load` beside three eager steps: losses, gradients and parameters within the tolerances
validation uses (`tasks.validate.stage.step_tolerance`: wider for a bfloat16 model or an autocast loss)."""

from __future__ import annotations

import copy
import textwrap

import pytest
import torch

import memplan
from memplan.tasks.config import ModelConfig, ValidateConfig
from memplan.tasks.models import build_batch, build_loss, build_model
from memplan.tasks.validate.stage import float64_problem, step_tolerance

from tests.pipeline.zoo_models import BATCH, FACTORIES, FAMILIES

VALIDATE = ValidateConfig(steps=1, max_steps=1, warmup=0)
PROFILE = {"warmup": 0, "repeats": 1}

XFAIL: dict[str, str] = {}
"""Families that do not plan or train as eager yet, with the precise failure."""


def cases() -> list:
    return [pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=XFAIL[name])) if name in XFAIL else name
            for name in FAMILIES]


@pytest.fixture
def factories(tmp_path, monkeypatch):
    (tmp_path / "zoo_factories.py").write_text(textwrap.dedent(FACTORIES))
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.parametrize("family", cases())
def test_each_family_plans_validates_and_trains_as_eager(family, tmp_path, factories):
    torch.set_num_threads(1)
    spec = ModelConfig.model_validate({"name": family, "batch_sizes": [BATCH], **FAMILIES[family]})
    model, loss_fn = build_model(spec, 0), build_loss(spec)
    batch = build_batch(spec, BATCH, 0)
    eager = copy.deepcopy(model)

    plan = memplan.plan(model, loss_fn, batch, max_overhead=0.10, solver="dtr", store=str(tmp_path / "store"),
                        name=family, profile=PROFILE, validate=VALIDATE, walk=False)
    assert plan.predicted["peak_bytes"] > 0

    step = memplan.load(plan, model, loss_fn)
    rtol, atol = step_tolerance(spec, VALIDATE)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, eager)]
    for i in range(3):
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        torch.manual_seed(i)                # the same dropout and stochastic-depth draws on both sides
        loss = step(*batch)
        torch.manual_seed(i)
        expected = loss_fn(eager, *batch)
        expected.backward()
        exact = float64_grads(eager, loss_fn, batch, i) if spec.dtype != "float32" or spec.autocast else None
        close(loss, expected, rtol, atol, f"step {i} loss")
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            assert (p.grad is None) == (q.grad is None), f"step {i}: {name} has a gradient on one side only"
            if q.grad is not None:
                close(p.grad, q.grad, rtol, atol, f"step {i} gradient of {name}", None if exact is None else exact[name])
        for opt in optimizers:
            opt.step()
    low = spec.dtype != "float32"                # bfloat16 parameters: gradients that differ by an ulp (accepted
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):   # above) move an element an ulp apart
        scale = rtol * float(q.detach().abs().max()) if low else atol        # (one rounding at the tensor's scale)
        close(p, q, rtol, max(atol, scale), f"parameter {name} after 3 steps")


def float64_grads(eager: torch.nn.Module, loss_fn, batch: tuple, seed: int) -> dict[str, torch.Tensor]:
    """The gradients of eager's step in float64 from eager's present parameters (the float64 step validation
    compares a low-precision plan against, tasks/validate/reference.py)."""
    wide = copy.deepcopy(eager).double()
    wide.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss_fn(wide, *(t.double() if t.is_floating_point() else t for t in batch)).backward()
    return {name: p.grad for name, p in wide.named_parameters() if p.grad is not None}


def close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float, what: str,
          exact: torch.Tensor | None = None) -> None:
    """`actual` within rtol / atol of `expected`, or, with the float64 step's `exact`, as validation accepts a
    low-precision tensor beyond them (`tasks.validate.stage.float64_problem`: no farther from the float64 value than a
    small multiple of eager's own distance)."""
    if torch.allclose(actual.detach(), expected.detach(), rtol=rtol, atol=atol, equal_nan=True):
        return
    if exact is not None:
        problem = float64_problem(expected, actual, exact.double() - expected.detach().double())
        assert problem is None, f"{what}: differs from eager beyond rtol {rtol:g} / atol {atol:g} {problem}"
        return
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")
