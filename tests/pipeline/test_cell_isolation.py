"""A cell's failure stays in its cell: a solver that raises, a validation that raises for one plan of a model and
a model that cannot be built each fail their own cells, in one paragraph naming the cell, the stage and the error,
while every other cell validates and publishes and the run fails (exit status 1). And transformers models the
pipeline builds are built for training: no key/value cache, so a recomputed layer appends to none."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from torch.utils.checkpoint import CheckpointError
from typer.testing import CliRunner

from memplan.flows.cli import app

runner = CliRunner(env={"COLUMNS": "250"})

CELLNET = '''
from torch import nn


def mlp(width=32, depth=4):
    layers = []
    for i in range(depth):
        layers += [nn.Linear(8 if i == 0 else width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 4))


def broken():
    raise RuntimeError("the factory ran out of parts")
'''

PIPELINE = '''
device = "cpu"

[[models]]
name = "mlp"
factory = "cellnet:mlp"
batch_sizes = [64]
inputs = [{ shape = [8] }, { shape = [], dtype = "int64", high = 4 }]

[[models]]
name = "broken"
factory = "cellnet:broken"
batch_sizes = [64]
inputs = [{ shape = [8] }, { shape = [], dtype = "int64", high = 4 }]

[profile]
warmup = 0
repeats = 1

[[plans]]
solver = "checkpoint-all"
budgets = [1.0]

[[plans]]
solver = "chen-sqrt-n"
budgets = [1.0]
models = ["mlp"]

[[plans]]
solver = "boom"
budgets = [1.0]
models = ["mlp"]

[validate]
steps = 1
max_steps = 1
warmup = 0
'''

GOOD, RAISES_IN_VALIDATE, RAISES_IN_SOLVE, UNBUILT = ("mlp-b64-checkpoint-all-100pct", "mlp-b64-chen-sqrt-n-100pct",
                                                      "mlp-b64-boom-100pct", "broken-b64-checkpoint-all-100pct")


def boom(problem, budget, options):
    raise RuntimeError("the solver fell over")


def raising_for_chen(first_run):
    """`tasks.validate.stage._first_run`, raising as a recomputation that differs from the forward does for the plans of
    chen-sqrt-n."""
    def run(plan, *args):
        if plan.provenance.get("solver") == "chen-sqrt-n":
            raise CheckpointError("torch.utils.checkpoint: Recomputed values for the following tensors have different "
                                  "metadata than during the forward pass.\ntensor at position 12: shape [16, 512, 64]")
        return first_run(plan, *args)

    return run


@pytest.fixture(scope="module")
def failing_run(tmp_path_factory, harness):
    """The pipeline run once with the `boom` solver registered and chen-sqrt-n's validation raising: its folder and
    the `PipelineFailed` it raised; the solver stays registered for the module's tests."""
    from memplan.flows.plan import PipelineFailed, run_plan
    from memplan.tasks.validate import stage as validate
    from memplan.tasks.solve import SOLVERS, SolverSpec

    folder = tmp_path_factory.mktemp("cells")
    (folder / "cellnet.py").write_text(CELLNET)
    (folder / "pipeline.toml").write_text(PIPELINE)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(SOLVERS, "boom", SolverSpec("boom", boom, "raises."))
        patch.setattr(validate, "_first_run", raising_for_chen(validate._first_run))
        for key in ("PREFECT_LOGGING_LEVEL", "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL"):
            patch.delenv(key, raising=False)                # `memplan run` sets them (flows.console.prepare)
        with pytest.raises(PipelineFailed) as failed:
            run_plan(folder / "pipeline.toml")
        yield folder, failed.value


def outcome(failed, alias: str) -> dict:
    (found,) = [o for o in failed.outcomes if o["alias"] == alias]
    return found


def test_a_cell_whose_solver_raises_fails_alone_in_one_paragraph(failing_run):
    from memplan.tasks.publish import read_index

    folder, failed = failing_run
    cell = outcome(failed, RAISES_IN_SOLVE)
    assert (cell["status"], cell["failed_stage"], cell["error"]) == ("failed", "solve", "RuntimeError")
    assert cell["message"] == f"{RAISES_IN_SOLVE} failed in its solve stage: RuntimeError: the solver fell over."
    assert outcome(failed, GOOD)["status"] == "published"
    assert {r["alias"] for r in read_index(folder / "plans")} == {GOOD}
    assert str(failed).startswith("3 of 4 plans were not published (1 were): ") and cell["message"] in str(failed)


def test_a_validation_raising_for_one_plan_leaves_the_other_plan_of_the_model_validated_and_published(failing_run):
    """Both plans of mlp at batch 64 are validated in one group, timed in the same rounds."""
    folder, failed = failing_run
    cell = outcome(failed, RAISES_IN_VALIDATE)
    assert (cell["status"], cell["failed_stage"], cell["error"]) == ("failed", "validate", "CheckpointError")
    assert cell["message"].startswith(f"{RAISES_IN_VALIDATE} failed in its validate stage: CheckpointError: "
                                      "torch.utils.checkpoint: Recomputed values")
    assert "\n" not in cell["message"] and cell["budget_bytes"] is not None          # what its solve found
    good = outcome(failed, GOOD)
    assert good["status"] == "published" and good["measured_peak_bytes"] > 0
    assert (folder / "plans" / f"{GOOD}.json").exists()
    assert not (folder / "plans" / f"{RAISES_IN_VALIDATE}.json").exists()


def test_a_model_that_cannot_be_built_fails_its_own_cells_only(failing_run):
    from memplan.tasks.config import expand_matrix, load_config

    folder, failed = failing_run
    cell = outcome(failed, UNBUILT)
    assert (cell["status"], cell["failed_stage"], cell["error"]) == ("failed", "trace", "ModelError")
    assert cell["message"].startswith(f"{UNBUILT} failed in its trace stage: ModelError: model 'broken'")
    assert "the factory ran out of parts" in cell["message"]
    cases = expand_matrix(load_config(folder / "pipeline.toml"))                    # in the matrix's order
    assert [o["alias"] for o in failed.outcomes] == [c.alias for c in cases]


def test_memplan_run_shows_each_failed_cell_and_exits_1(failing_run):
    """Again from the command line, on the cached stages (the validation's error is a cached record): the table
    says where each cell failed, the error paragraph why, and no traceback."""
    folder, failed = failing_run
    result = runner.invoke(app, ["run", str(folder / "pipeline.toml")])
    assert result.exit_code == 1, result.output
    rows = {line.split("│")[1].strip(): line.split("│")[-2].strip() for line in result.output.splitlines()
            if line.startswith("│ ") and line.split("│")[1].strip() in {o["alias"] for o in failed.outcomes}}
    assert rows == {GOOD: "published", RAISES_IN_VALIDATE: "failed in validate (CheckpointError)",
                    RAISES_IN_SOLVE: "failed in solve (RuntimeError)", UNBUILT: "failed in trace (ModelError)"}
    text = " ".join(result.output.split())
    assert f"{RAISES_IN_SOLVE} failed in its solve stage: RuntimeError: the solver fell over. " in text
    assert "Traceback" not in result.output


def test_the_runs_table_says_why_a_cell_failed(failing_run):
    from memplan.flows.report import Outcome, markdown_table

    _, failed = failing_run
    row, = [line for line in markdown_table([Outcome(**outcome(failed, RAISES_IN_SOLVE))]).splitlines()
            if line.startswith(f"| {RAISES_IN_SOLVE} ")]
    assert row.endswith(f"| {RAISES_IN_SOLVE} failed in its solve stage: RuntimeError: the solver fell over. |")


# -- one plan's error inside the validation of several --------------------------------------------------------


@pytest.fixture(scope="module")
def mlp_cell(tmp_path_factory):
    """A model spec, its reference at batch 32 and two plans of it (the second with another budget)."""
    import sys
    import types

    from memplan import runtime
    from memplan.runtime.format.plan import default_plan
    from memplan.tasks.config import ModelConfig
    from memplan.tasks.models import build_batch, build_loss, build_model
    from memplan.tasks.validate.reference import measure_reference

    module = types.ModuleType("tests_cell_isolation_models")
    module.mlp = lambda: torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 16))
    sys.modules[module.__name__] = module
    spec = ModelConfig(name="mlp", factory="tests_cell_isolation_models:mlp", loss="mse",
                       inputs=[{"shape": [16]}, {"shape": [16]}])
    plan = default_plan(runtime.capture(build_model(spec, 0), build_loss(spec), build_batch(spec, 32, 0, "cpu")))
    plans = [replace(plan, provenance={"solver": solver, "budget_bytes": 10**9}) for solver in ("a", "b")]
    reference = measure_reference(spec, 32, "cpu", 0, tmp_path_factory.mktemp("reference") / "mlp.safetensors")
    yield spec, reference, plans
    del sys.modules[module.__name__]


def test_validate_plans_isolates_a_plan_that_raises(mlp_cell, monkeypatch):
    from memplan.runtime.format.plan import plan_id
    from memplan.tasks.validate import stage as validate
    from memplan.tasks.config import ValidateConfig
    from memplan.tasks.records import StageError, Validated

    spec, reference, plans = mlp_cell
    real = validate._first_run

    def first_run(plan, *args):
        if plan.provenance["solver"] == "a":
            raise CheckpointError("recomputed values differ")
        return real(plan, *args)

    monkeypatch.setattr(validate, "_first_run", first_run)
    settings = ValidateConfig(steps=1, max_steps=1, warmup=0)
    errored, passed = validate.validate_plans(plans, spec, 32, "cpu", 0, settings, reference, isolate=True)
    assert errored == StageError(stage="validate", error="CheckpointError", message="recomputed values differ",
                                 plan_id=plan_id(plans[0]))
    assert isinstance(passed, Validated) and passed.passed and passed.plan_id == plan_id(plans[1]), passed
    with pytest.raises(CheckpointError, match="recomputed values differ"):       # without isolate: raised
        validate.validate_plans(plans, spec, 32, "cpu", 0, settings, reference)


def test_a_long_error_keeps_its_start_and_its_end():
    from memplan.tasks.records import MESSAGE_CHARS, StageError

    error = StageError.of("validate", RuntimeError("start\n" + "x" * 5000 + "\nraise the budget."))
    assert len(error.message) <= MESSAGE_CHARS + 3 and error.message.startswith("start x")
    assert error.message.endswith("x raise the budget.") and " … " in error.message


# -- transformers models built for training ------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt2():
    """The pipeline's GPT-2 from a tiny config (2 layers, 64 wide, transformers' defaults: SDPA attention, dropout),
    its causal_lm loss and a batch."""
    from memplan.tasks.config import ModelConfig
    from memplan.tasks.models import build_batch, build_loss, build_model

    spec = ModelConfig(name="gpt2", transformers="gpt2", loss="causal_lm",
                       kwargs={"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 128, "n_positions": 32,
                               "bos_token_id": 0, "eos_token_id": 0},
                       inputs=[{"shape": [32], "dtype": "int64", "high": 128}])
    return build_model(spec, 0), build_loss(spec), build_batch(spec, 4, 0)


@pytest.fixture(scope="module")
def gpt2_graph(gpt2):
    """`gpt2`'s step as the policy form plans on it (`capture_eager`)."""
    from memplan.runtime.policy.apply import capture_eager

    model, loss_fn, batch = gpt2
    return capture_eager(copy.deepcopy(model), loss_fn, batch)


def test_a_pipeline_built_transformers_model_trains_without_a_cache(gpt2):
    model, loss_fn, batch = gpt2
    assert model.config.use_cache is False and model.config._attn_implementation == "sdpa"
    seen = []
    hook = model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs), with_kwargs=True)
    try:
        loss_fn(model, *batch)
    finally:
        hook.remove()
    assert [k.get("use_cache") for k in seen] == [False]


def test_a_policy_plan_recomputing_attention_trains_like_eager(gpt2, gpt2_graph):
    """A recomputed attention layer appended to the key/value cache again when the loss ran with one (this plan:
    a RuntimeError, keys of 64 tokens, not 32; on a GPU a CheckpointError); without one the plan trains to eager's
    gradients, dropout drawn alike. `runtime.apply` still refuses a model whose config keeps the cache, naming the
    fix."""
    from memplan import runtime
    from memplan.runtime.format.plan import graph_provenance
    from memplan.runtime.policy.form import PolicyFormError, Regions, decisions, policy_schedule
    from memplan.tasks.solve import solve
    from memplan.tasks.solve.core.problem import Problem
    from memplan.tasks.solve.core.simulator import simulate

    model, loss_fn, batch = gpt2
    graph = gpt2_graph
    problem, regions = Problem.from_graph(graph), Regions.of_graph(graph)
    budget = simulate(problem, policy_schedule(regions, {r: frozenset() for r in regions.members})).peak_bytes
    solution = solve(problem, "selective-policy", int(0.9 * budget))           # below whole layers: split ones
    assert solution.feasible, solution.message
    plan = solution.to_plan(problem)
    plan.provenance.update(graph_provenance(graph))
    split = Regions.of_graph(graph, plan.provenance.get("split", []), plan.provenance.get("nest", []))
    assert any(name.endswith(".attn") for name in decisions(split, plan.schedule))     # attention is recomputed
    eager, planned = copy.deepcopy(model), runtime.apply(plan, copy.deepcopy(model), loss_fn, batch, graph=graph)
    for trained in (eager, planned):
        torch.manual_seed(1)
        loss_fn(trained, *batch).backward()
    for (name, p), q in zip(eager.named_parameters(), planned.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-6, msg=lambda m: f"grad {name}: {m}")
    cached = copy.deepcopy(model)
    cached.config.use_cache = True
    with pytest.raises(PolicyFormError, match=r"Set model.config.use_cache = False .* pass no use_cache=True"):
        runtime.apply(plan, cached, loss_fn, batch, graph=graph)


def test_capture_traces_the_step_without_a_cache(gpt2_graph):
    """No cache: the forward holds no copies of the keys and values nor the empty tensors a cache starts from."""
    forward = {t for n in gpt2_graph.nodes if n.phase == "forward" for t in n.targets}
    assert not forward & {"aten.cat.default", "aten.lift_fresh_copy.default"}, forward


def test_a_rung_of_the_measured_walk_that_raises_fails_its_cell():
    """The predicted choice measures over the limit, so the walk validates the rung with more memory, which raises:
    the cell fails with that error rather than publishing another rung."""
    from memplan.flows.refine import measured_choices
    from memplan.tasks.config import expand_matrix, parse_config
    from memplan.tasks.records import Candidate, Solved, StageError, Validated

    linear = {"name": "linear", "factory": "torch.nn:Linear", "kwargs": {"in_features": 4, "out_features": 3},
              "loss": "mse", "inputs": [{"shape": [4]}, {"shape": [3]}]}
    case, = expand_matrix(parse_config({"models": [linear], "plans": [{"solver": "dtr", "max_overhead": 0.10}]}))
    rungs = [Candidate(plan_path=f"rung{i}.json", plan_id=f"{i}" * 64, budget_bytes=peak, predicted_peak_bytes=peak,
                       predicted_overhead=overhead) for i, (peak, overhead) in enumerate([(900, 0.0), (600, 0.08)])]
    solved = Solved(solver="dtr", status="optimal", feasible=True, budget_bytes=600, checkpoint_all_peak_bytes=900,
                    checkpoint_all_cost=1.0, predicted_peak_bytes=600, arena_bytes=None, objective=1.08, gap=None,
                    solve_seconds=0.0, backend=None, min_budget_lower_bound=None, smallest_feasible_budget=None,
                    message="", plan_path="rung1.json", plan_id="1" * 64, profile_run_id=None, max_overhead=0.10,
                    candidates=rungs, no_recompute_path="none.json", no_recompute_id="n" * 64)
    over = Validated(plan_id="1" * 64, passed=True, reasons=[], device="cpu", device_name="cpu", budget_bytes=600,
                     predicted_peak_bytes=600, measured_peak_bytes=600, eager_peak_bytes=900, measured_step_ms=1.3,
                     eager_step_ms=1.0, overhead=0.3, loss=0.0, eager_loss=0.0, max_abs_error=0.0, tensors_compared=1,
                     overhead_vs_no_recompute=0.3, overhead_vs_no_recompute_interval=[0.25, 0.35])
    error = StageError(stage="validate", error="CheckpointError", message="recomputed values differ", plan_id="0" * 64)
    asked = []

    def validate(groups):
        asked.extend(p.plan_path for group in groups.values() for _, p in group)
        return {cell: [error for _ in group] for cell, group in groups.items()}

    solutions, validations, walks = measured_choices([case], [solved], {case.alias: over}, validate)
    assert asked == ["rung0.json"] and solutions == [solved] and case.alias not in walks
    assert validations[case.alias] == error.model_copy(update={"stage": "measured walk"})
