"""The validation gate: the tolerance is atol + rtol * |eager| (not the other way round), a gradient just
outside it fails, and a plan whose measured peak breaks its budget is not passed."""

from __future__ import annotations

import pytest
import torch

from memplan.tasks.records import Validated
from memplan.tasks.validate.stage import compare_tensors, peak_problem

RTOL, ATOL = 1e-4, 1e-5                        # the defaults of [validate]


def limit(eager: float) -> float:
    return ATOL + RTOL * abs(eager)


@pytest.mark.parametrize("eager", [0.0, 1e-3, 1.0, -250.0])
def test_a_gradient_just_outside_the_tolerance_fails_and_just_inside_passes(eager):
    want = {"grad:w": torch.tensor([eager, 3.0], dtype=torch.float64)}
    inside = {"grad:w": torch.tensor([eager + 0.99 * limit(eager), 3.0], dtype=torch.float64)}
    outside = {"grad:w": torch.tensor([eager - 1.01 * limit(eager), 3.0], dtype=torch.float64)}
    assert compare_tensors(want, inside, RTOL, ATOL) == ([], pytest.approx(0.99 * limit(eager)), 1)
    problems, worst, compared = compare_tensors(want, outside, RTOL, ATOL)
    assert problems == [f"grad:w differs from eager by up to {1.01 * limit(eager):.3g} (rtol 0.0001, atol 1e-05)"]
    assert worst == pytest.approx(1.01 * limit(eager)) and compared == 1


def test_rtol_scales_with_the_eager_value_and_atol_does_not():
    """Differences that pass or fail only if rtol and atol are used in their own places."""
    big = {"loss": torch.tensor(100.0, dtype=torch.float64)}
    zero = {"loss": torch.tensor(0.0, dtype=torch.float64)}
    # |diff| 5e-3 at eager 100: within 1e-5 + 1e-4 * 100 = 1.001e-2, not within 1e-4 + 1e-5 * 100 = 1.1e-3
    assert compare_tensors(big, {"loss": big["loss"] + 5e-3}, RTOL, ATOL)[0] == []
    # |diff| 5e-5 at eager 0: not within 1e-5, within 1e-4 (the swapped tolerance)
    assert compare_tensors(zero, {"loss": zero["loss"] + 5e-5}, RTOL, ATOL)[0] != []


def test_the_first_mismatch_names_the_tensor_and_later_ones_follow_in_order():
    want = {"loss": torch.tensor(1.0), "grad:a": torch.zeros(2), "grad:b": torch.zeros(2)}
    got = {"loss": torch.tensor(1.0), "grad:a": torch.tensor([0.0, 1.0]), "grad:b": torch.tensor([2.0, 0.0])}
    problems, worst, compared = compare_tensors(want, got, RTOL, ATOL)
    assert [p.split()[0] for p in problems] == ["grad:a", "grad:b"]
    assert worst == 2.0 and compared == 3


def test_nan_in_both_runs_is_equal_and_nan_in_one_is_not():
    assert compare_tensors({"g": torch.tensor([float("nan")])}, {"g": torch.tensor([float("nan")])}, 0, 0)[0] == []
    assert compare_tensors({"g": torch.tensor([0.0])}, {"g": torch.tensor([float("nan")])}, 1, 1)[0] != []


def test_empty_tensors_compare_equal():
    assert compare_tensors({"g": torch.zeros(0)}, {"g": torch.zeros(0)}, RTOL, ATOL) == ([], 0.0, 1)


@pytest.mark.parametrize("measured, budget, slack, over", [
    (1000, 1000, 0.0, False), (1001, 1000, 0.0, True), (1100, 1000, 0.1, False), (1101, 1000, 0.1, True),
])
def test_peak_limit_is_budget_times_one_plus_slack(measured, budget, slack, over):
    assert (peak_problem(measured, budget, slack) is not None) == over


def test_explain_names_the_plan_the_device_and_the_first_reasons():
    record = Validated(plan_id="0" * 64, passed=False, reasons=["a", "b", "c", "d", "e"], device="cpu", device_name="cpu", budget_bytes=1,
                       predicted_peak_bytes=1, measured_peak_bytes=1, eager_peak_bytes=1, measured_step_ms=1.0,
                       eager_step_ms=1.0, overhead=0.0, loss=1.0, eager_loss=1.0, max_abs_error=0.0, tensors_compared=1)
    assert record.explain("p.json") == "plan p.json failed validation on cpu: a; b; c; and 2 more."
    assert record.explain("p.json", shown=5) == "plan p.json failed validation on cpu: a; b; c; d; e."
    assert record.explain("p.json", shown=4) == "plan p.json failed validation on cpu: a; b; c; d; and 1 more."
    assert Validated.from_json(record.to_json()) == record


# -- validate_plan end to end on a tiny model ----------------------------------------------------------

def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 16))


@pytest.fixture(scope="module")
def mlp_spec():
    import sys
    import types

    from memplan.tasks.config import ModelConfig

    module = types.ModuleType("tests_validate_gate_models")
    module.mlp = _mlp
    sys.modules[module.__name__] = module
    yield ModelConfig(name="mlp", factory="tests_validate_gate_models:mlp", loss="mse",
                      inputs=[{"shape": [16]}, {"shape": [16]}])
    del sys.modules[module.__name__]


@pytest.fixture(scope="module")
def mlp_plan(mlp_spec):
    from memplan import runtime
    from memplan.runtime.format.plan import default_plan
    from memplan.tasks.models import build_batch, build_loss, build_model

    graph = runtime.capture(build_model(mlp_spec, 0), build_loss(mlp_spec), build_batch(mlp_spec, 32, 0, "cpu"))
    return default_plan(graph)


@pytest.fixture(scope="module")
def mlp_reference(mlp_spec, tmp_path_factory):
    from memplan.tasks.validate.reference import measure_reference

    return measure_reference(mlp_spec, 32, "cpu", 0, tmp_path_factory.mktemp("reference") / "mlp.safetensors")


def _validate(plan, spec, budget, reference, **settings):
    from dataclasses import replace

    from memplan.tasks.config import ValidateConfig
    from memplan.tasks.validate.stage import validate_plan

    plan = replace(plan, provenance=dict(plan.provenance, budget_bytes=budget) if budget else {})
    return validate_plan(plan, spec, 32, "cpu", 0, ValidateConfig(steps=1, max_steps=1, warmup=0, **settings),
                         reference)


def test_a_plan_over_its_budget_fails_with_the_tolerances_in_their_places(mlp_spec, mlp_plan, mlp_reference,
                                                                          monkeypatch):
    """Budget 1 B: the plan reproduces eager exactly, so the peak is the one reason it fails; the
    comparison receives rtol and atol from the settings in their own places."""
    from memplan.tasks.validate import stage as validate
    seen = []
    real = validate.compare_tensors

    def spy(expected, actual, rtol, atol, **float64):
        seen.append((rtol, atol))
        return real(expected, actual, rtol, atol, **float64)

    monkeypatch.setattr(validate, "compare_tensors", spy)
    over = _validate(mlp_plan, mlp_spec, 1, mlp_reference, rtol=0.25, atol=0.5)
    assert seen == [(0.25, 0.5)]
    assert over.tensors_compared == 5 and over.max_abs_error == 0.0           # loss and 4 gradients
    assert not over.passed and over.measured_peak_bytes > 1 and over.budget_bytes == 1
    assert over.reasons == [peak_problem(over.measured_peak_bytes, 1, 0.05)]


def test_a_plan_without_a_budget_is_not_passed(mlp_spec, mlp_plan, mlp_reference):
    result = _validate(mlp_plan, mlp_spec, None, mlp_reference)
    assert not result.passed
    assert result.reasons == ["the plan has no provenance.budget_bytes to check the measured peak against"]
