"""The reference stage: eager PyTorch's step measured once per model x batch size, stored without pickle,
judging every plan of its cell as eager run beside each plan did; budgets as fractions of eager's peak."""

from __future__ import annotations

import sys
import types
from dataclasses import replace

import pytest
import torch

from memplan.tasks.config import Budget, ConfigError, MemplanError, ModelConfig, ValidateConfig, parse_budget, parse_config


def _net():
    """Linear layers and a BatchNorm (buffers a step updates)."""
    return torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.BatchNorm1d(12), torch.nn.Tanh(),
                               torch.nn.Linear(12, 4))


@pytest.fixture(scope="module")
def spec():
    module = types.ModuleType("tests_reference_models")
    module.net = _net
    sys.modules[module.__name__] = module
    yield ModelConfig(name="net", factory="tests_reference_models:net", loss="mse", inputs=[{"shape": [8]}, {"shape": [4]}])
    del sys.modules[module.__name__]


@pytest.fixture(scope="module")
def reference(spec, tmp_path_factory):
    from memplan.tasks.validate.reference import measure_reference

    return measure_reference(spec, 16, "cpu", 0, tmp_path_factory.mktemp("reference") / "net.safetensors")


@pytest.fixture(scope="module")
def plans(spec):
    """The checkpoint-all plan of the net's graph, within a generous budget and within 1 byte."""
    from memplan import runtime
    from memplan.runtime.format.plan import default_plan
    from memplan.tasks.models import build_batch, build_loss, build_model

    plan = default_plan(runtime.capture(build_model(spec, 0), build_loss(spec), build_batch(spec, 16, 0, "cpu")))
    return [replace(plan, provenance=dict(plan.provenance, budget_bytes=budget)) for budget in (10**9, 1)]


SETTINGS = ValidateConfig(steps=1, max_steps=1, warmup=0)


def test_the_reference_holds_eager_state_after_one_step_in_a_safetensors_file(spec, reference):
    from safetensors import safe_open

    from memplan.tasks.models import build_batch, build_loss, build_model
    from memplan.tasks.validate.reference import reference_state, step_state

    model = build_model(spec, 0)
    loss = build_loss(spec)(model, *build_batch(spec, 16, 0, "cpu"))
    loss.backward()
    eager = step_state(model, loss)
    stored = reference_state(reference, "cpu")
    assert list(stored)[0] == "loss" and set(stored) == set(eager)
    for name, tensor in eager.items():
        assert (stored[name] is None) == (tensor is None), name
        assert tensor is None or torch.equal(stored[name], tensor), name
    assert reference.absent == [] and reference.tensors == len(eager) == 10
    assert reference.loss == float(loss.detach()) and reference.peak_bytes > 0 and reference.kind == "eager"
    stored_keys = {k for k, v in eager.items() if v is not None}
    floating = {k for k in stored_keys if eager[k].is_floating_point()}      # and the float64 step's distances
    with safe_open(reference.path, "pt") as f:                    # a safetensors file, no pickle in it
        assert set(f.keys()) == stored_keys | {f"float64:{k}" for k in floating}
    assert reference.float64_tensors == len(floating) == 9 and reference.float64_skipped is None


def test_absent_gradients_come_back_as_none_in_report_order(reference, tmp_path):
    """A gradient that does not exist is not stored; reading the file gives it back as None, the loss first."""
    from memplan.tasks.validate.reference import reference_state, write_state

    state = {"buffer:b": torch.arange(3), "grad:w": None, "loss": torch.tensor(2.0), "grad:a": torch.ones(2)}
    stored = reference.model_copy(update={"path": str(write_state(tmp_path / "s.safetensors", state)),
                                          "absent": ["grad:w"]})
    back = reference_state(stored, "cpu")
    assert list(back) == ["loss", "grad:a", "grad:w", "buffer:b"] and back["grad:w"] is None
    assert all(torch.equal(back[k], v) for k, v in state.items() if v is not None)


def test_a_plan_checked_against_the_reference_keeps_its_verdicts(spec, reference, plans):
    """The plan that reproduces eager passes; the same plan within 1 byte fails on its peak alone."""
    from memplan.tasks.validate.stage import peak_problem, validate_plan

    fits, over = (validate_plan(p, spec, 16, "cpu", 0, SETTINGS, reference) for p in plans)
    assert fits.passed and fits.reasons == [] and fits.max_abs_error == 0.0 and fits.tensors_compared == 10
    assert fits.eager_peak_bytes == reference.peak_bytes and fits.eager_loss == reference.loss
    assert not over.passed and over.reasons == [peak_problem(over.measured_peak_bytes, 1, 0.05)]


def test_a_reference_whose_gradient_differs_fails_the_plan_naming_the_gradient(spec, reference, plans, tmp_path):
    """Equivalently, a plan whose gradient differs from eager's by more than the tolerance fails."""
    from memplan.tasks.validate.reference import reference_state, write_state
    from memplan.tasks.validate.stage import validate_plan

    state = reference_state(reference, "cpu")
    state["grad:3.weight"] = state["grad:3.weight"] + 1e-3
    perturbed = reference.model_copy(update={"path": str(write_state(tmp_path / "perturbed.safetensors", state))})
    failed = validate_plan(plans[0], spec, 16, "cpu", 0, SETTINGS, perturbed)
    assert not failed.passed
    assert len(failed.reasons) == 1 and failed.reasons[0].startswith("grad:3.weight differs from eager by up to 0.001")


def test_plans_validated_together_get_the_verdicts_they_get_alone(spec, reference, plans):
    from memplan.tasks.validate.stage import validate_plan, validate_plans

    together = validate_plans(plans, spec, 16, "cpu", 0, ValidateConfig(steps=2, max_steps=2, warmup=0), reference)
    alone = [validate_plan(p, spec, 16, "cpu", 0, SETTINGS, reference) for p in plans]
    assert [(v.plan_id, v.passed, v.reasons, v.measured_peak_bytes) for v in together] == \
        [(v.plan_id, v.passed, v.reasons, v.measured_peak_bytes) for v in alone]
    assert all(v.timed_steps == 2 for v in together)


def test_a_reference_of_another_cell_is_refused(spec, reference, plans):
    from memplan.tasks.validate.stage import validate_plan

    with pytest.raises(MemplanError, match="is of model net at batch 16 on cpu with seed 0, not of net at batch 8"):
        validate_plan(plans[0], spec, 8, "cpu", 0, SETTINGS, reference)


def test_a_missing_reference_file_says_how_to_rebuild_it(spec, reference, plans):
    from memplan.tasks.validate.stage import validate_plan

    gone = reference.model_copy(update={"path": "/nonexistent/net.safetensors"})
    with pytest.raises(MemplanError, match="re-run with `memplan run --refresh`"):
        validate_plan(plans[0], spec, 16, "cpu", 0, SETTINGS, gone)


def _in_step_plan(spec, optimizer: str):
    """A plan of the net with `optimizer` inside the step (no recomputation), as the solve stage records it."""
    from memplan import runtime
    from memplan.runtime.format.plan import graph_provenance
    from memplan.tasks.models import build_batch, build_loss, build_model
    from memplan.tasks.solve.core.optimizer import in_step
    from memplan.tasks.solve.core.problem import Problem
    from memplan.tasks.solve.core.simulator import default_schedule
    from memplan.tasks.solve.core.solution import checked_solution

    graph = runtime.capture(build_model(spec, 0), build_loss(spec), build_batch(spec, 16, 0, "cpu"))
    problem = in_step(Problem.from_graph(graph), graph.gradient_updates(), optimizer)
    plan = checked_solution(problem, "test", 10**9, default_schedule(problem)).to_plan(problem)
    plan.provenance.update(graph_provenance(graph), budget_bytes=10**9, optimizer_in_step=optimizer)
    return plan


def test_a_cell_mixing_the_optimizer_inside_and_outside_the_step_is_validated_against_one_reference(
        spec, plans, tmp_path):
    """The reference measured with the optimizer also holds its parameters after the update: the plan updating
    inside the step is compared on parameters, the other on gradients, both against that one reference."""
    from memplan.tasks.validate.reference import measure_reference, reference_state
    from memplan.tasks.validate.stage import validate_plans

    reference = measure_reference(spec, 16, "cpu", 0, tmp_path / "r.safetensors", optimizer="sgd-momentum")
    state = reference_state(reference, "cpu")
    assert reference.optimizer == "sgd-momentum" and any(k.startswith("param:") for k in state)
    inside, outside = _in_step_plan(spec, "sgd-momentum"), plans[0]
    checked = validate_plans([inside, outside], spec, 16, "cpu", 0, SETTINGS, reference)
    assert [v.passed for v in checked] == [True, True], [v.reasons for v in checked]
    params = sum(k.startswith("param:") for k in state)
    grads = sum(k.startswith("grad:") for k in state)
    assert checked[0].tensors_compared >= 1 + params and checked[1].tensors_compared >= 1 + grads


def test_a_plan_updating_inside_the_step_needs_a_reference_with_that_optimizer(spec, reference):
    from memplan.tasks.validate.stage import validate_plan

    with pytest.raises(MemplanError, match=r"optimizer \['adamw'\] inside the step need a reference with that"):
        validate_plan(_in_step_plan(spec, "adamw"), spec, 16, "cpu", 0, SETTINGS, reference)


# -- budgets relative to eager's measured peak ----------------------------------------------------------

@pytest.mark.parametrize("text, fraction", [("50% eager", 0.5), (" 120 %  Eager ", 1.2), ("1000% eager", 10.0),
                                            ("0.5% eager", 0.005)])
def test_a_fraction_of_eager_resolves_against_eager_peak(text, fraction):
    budget = parse_budget(text)
    assert budget == Budget(eager_fraction=pytest.approx(fraction))
    assert budget.of_eager(76_200_000) == Budget(bytes=int(fraction * 76_200_000))
    assert budget.label == f"{fraction * 100:g}pct-eager"
    assert Budget(fraction=0.5).of_eager(76_200_000) == Budget(fraction=0.5)        # other forms stay as they are
    with pytest.raises(ValueError, match="only the pipeline measures"):
        budget.resolve(10**6)


@pytest.mark.parametrize("text, says", [
    ("-50% eager", "asks for -50% of eager PyTorch's measured peak; a fraction of eager's peak must lie above 0% and "
                   "at most 1000%"),
    ("0% eager", "asks for 0%"), ("1000.5% eager", "asks for 1000.5%"), ("nan% eager", "asks for nan%"),
    ("half% eager", "'half' is not a number; write a percentage of eager PyTorch's measured peak such as '50% eager'"),
    ("50 eager", "is not understood"),
])
def test_bad_fractions_of_eager_are_refused_naming_the_key(config_data, text, says):
    config_data["plans"][0]["budgets"] = ["70%", text]
    with pytest.raises(ConfigError) as err:
        parse_config(config_data, solvers=["checkmate", "chen-sqrt-n"])
    assert f"plans[0].budgets[1] = {text!r}: budget {text!r}" in str(err.value) and says in str(err.value)


# -- the pipeline: one reference per cell, cached --------------------------------------------------------

PIPELINE = """
device = "cpu"

[[models]]
name = "mlp"
factory = "tinynet:mlp"
kwargs = { width = 32, depth = 6 }
batch_sizes = [256]
inputs = [{ shape = [8] }, { shape = [], dtype = "int64", high = 4 }]

[profile]
warmup = 1
repeats = 2

[[plans]]
solver = "chen-sqrt-n"
budgets = ["100% eager"]

[[plans]]
solver = "ap-greedy"
max_overhead = 0.25

[validate]
steps = 1
max_steps = 1
warmup = 0
"""


def test_one_reference_serves_every_plan_of_a_cell_and_sizes_eager_budgets(tmp_path, harness, monkeypatch):
    """Two plans of one cell: one reference (a second run takes it from the cache); the eager budget is
    eager's measured peak in bytes; one validation of the cell's two plans, timed together (an overhead
    search validates only the plan it returns: the solve stage cannot even import the validation), then
    the measured walk's validations of the max_overhead plan's rungs (tasks/validate/overhead.py), alone."""
    from memplan.tasks.validate import reference
    from memplan.tasks.validate import stage as validate_module
    from memplan.flows.codehash import ROOT, import_closure
    from memplan.flows.plan import run_plan
    from memplan.flows.report import Outcome, markdown_table
    from tests.pipeline.test_flows import TINYNET

    references, validations = [], []
    measure, validate = reference.measure_reference, validate_module.validate_plans
    monkeypatch.setattr(reference, "measure_reference",
                        lambda *a, **k: references.append(a[:2]) or measure(*a, **k))
    monkeypatch.setattr(validate_module, "validate_plans", lambda *a, **k: validations.append(a[0]) or validate(*a, **k))
    (tmp_path / "tinynet.py").write_text(TINYNET)
    (tmp_path / "pipeline.toml").write_text(PIPELINE)
    outcomes = run_plan(tmp_path / "pipeline.toml")
    assert [(spec.name, batch) for spec, batch in references] == [("mlp", 256)]
    assert [o["alias"] for o in outcomes] == ["mlp-b256-chen-sqrt-n-100pct-eager", "mlp-b256-ap-greedy-ovh25pct"]
    assert all(o["status"] == "published" for o in outcomes), outcomes
    from memplan.tasks.validate.overhead import EXTRA_VALIDATIONS

    first, *walked = [[p.provenance.get("max_overhead") for p in plans] for plans in validations]
    assert first == [None, 0.25] and walked == [[0.25]] * len(walked) and len(walked) <= EXTRA_VALIDATIONS
    eager_peak = outcomes[0]["eager_peak_bytes"]
    assert outcomes[0]["budget_bytes"] == eager_peak and outcomes[1]["eager_peak_bytes"] == eager_peak
    assert len(list((tmp_path / ".cache" / "memplan" / "references").glob("*.safetensors"))) == 1
    assert f"| {eager_peak / 2**20:.1f} (100% of eager) |" in markdown_table([Outcome(**o) for o in outcomes])
    assert ROOT / "tasks" / "validate.py" not in import_closure(("memplan.tasks.solve_stage",))
    assert run_plan(tmp_path / "pipeline.toml") == outcomes and len(references) == 1 and len(validations) == 1 + len(walked)


def test_a_fraction_of_eager_is_refused_where_eager_does_not_fit_the_device(config_data, reference):
    """Under a device memory limit eager PyTorch may not fit: the reference is then another step, whose peak is
    no measure of eager's, and a budget given as a fraction of eager's peak is refused before solving."""
    from memplan.flows.plan import check_eager_budgets
    from memplan.tasks.config import expand_matrix

    config_data["plans"][0]["budgets"] = ["70%", "50% eager"]
    cases = expand_matrix(parse_config(config_data, solvers=["checkmate", "chen-sqrt-n"]))
    cells = {(c.model.name, c.batch_size) for c in cases}
    check_eager_budgets(cases, dict.fromkeys(cells, reference))             # eager's own reference: fine
    checkpointed = reference.model_copy(update={"kind": "per-block checkpoint"})
    with pytest.raises(MemplanError, match="budget '50pct-eager' of .* is a fraction of eager PyTorch's peak, but "
                                           "eager does not fit device_memory there"):
        check_eager_budgets(cases, dict.fromkeys(cells, checkpointed))
