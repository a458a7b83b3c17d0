"""Policy-form plans from the pipeline (`[[plans]] form = "policy"`, the default of `selective-policy`): the
config refuses what the form cannot take, naming the key and the fix; `memplan run` traces the step as eager
PyTorch runs it, solves on it, validates the plan with `runtime.apply` in the same cell as an executor plan,
and publishes a plan that `runtime.apply` accepts and that trains to eager PyTorch's gradients."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from memplan.tasks.config import ConfigError, expand_matrix, parse_config

BLOCKNET = '''
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.up, self.down, self.drop = nn.Linear(width, 4 * width), nn.Linear(4 * width, width), nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.down(F.gelu(self.up(x), approximate="tanh")))


class BlockNet(nn.Module):
    """Residual MLP blocks in an nn.ModuleList (the repeated modules the policy form checkpoints), with
    dropout (drawn again by each recomputation) and tanh GELU and cross-entropy (which the executor's
    graph fuses, so its graph differs from the eager one)."""

    def __init__(self, width=64, depth=3, classes=8):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)
'''

BLOCKNET_PIPELINE = '''
device = "cpu"
{top}

[[models]]
name = "blocknet"
factory = "blocknet:BlockNet"
batch_sizes = [128]
inputs = [{{ shape = [64] }}, {{ shape = [], dtype = "int64", high = 8 }}]

[profile]
warmup = 0
repeats = 1
{plans}
[validate]
steps = 1
max_steps = 1
warmup = 0
compile_backend = "aot_eager"
'''
"""A pipeline.toml on BlockNet with one profiling call and one timed step (plans solved compiled measured under
aot_eager): `top` level keys and `plans` tables."""

PLANS = '''
[[plans]]
solver = "selective-policy"
budgets = [0.7, 0.1]

[[plans]]
solver = "checkpoint-all"
budgets = [1.0]

[[plans]]
solver = "selective-policy"
budgets = [0.75]
options = { compiled = true }
'''

LINEAR = {"name": "linear", "factory": "torch.nn:Linear", "kwargs": {"in_features": 4, "out_features": 3},
          "loss": "mse", "inputs": [{"shape": [4]}, {"shape": [3]}]}


def config(**plan):
    return parse_config({"models": [LINEAR], "plans": [{"budgets": [0.8]} | plan]}, "pipeline.toml")


def test_selective_policy_takes_the_policy_form_unless_told_otherwise():
    policy, = expand_matrix(config(solver="selective-policy"))
    assert policy.plan.plan_form == "policy" and policy.plan.solve_settings().form == "policy"
    assert policy.alias == "linear-b8-selective-policy-80pct"
    executor, = expand_matrix(config(solver="selective-policy", form="executor"))
    assert executor.plan.plan_form == "executor" and executor.alias == "linear-b8-selective-policy-executor-80pct"
    assert config(solver="dtr").plans[0].plan_form == "executor"
    assert config(solver="selective-policy", form="policy").plans[0].solve_settings().form == "policy"


def test_a_model_is_traced_for_the_forms_of_its_plans():
    from memplan.tasks.config import graph_forms

    data = {"models": [LINEAR, LINEAR | {"name": "other"}], "plans": [
        {"solver": "selective-policy", "budgets": [0.8], "models": ["linear"]},
        {"solver": "dtr", "budgets": [0.8], "models": ["linear"]}]}
    cases = expand_matrix(parse_config(data))
    assert graph_forms("linear", 8, cases) == ["executor", "policy"]
    assert graph_forms("other", 8, cases) == ["executor"]                   # no plan: traced as before
    data["plans"].pop()
    assert graph_forms("linear", 8, expand_matrix(parse_config(data))) == ["policy"]


def test_a_solver_that_cannot_make_policies_is_refused_with_the_ones_that_can():
    with pytest.raises(ConfigError, match=r"pipeline.toml .* key plans\[0\]: plan of solver 'checkmate' sets form = "
                                          r"\"policy\", but 'checkmate' makes schedules .*'selective-policy'.* or "
                                          r"form = \"executor\""):
        config(solver="checkmate", form="policy")


def test_the_capability_is_declared_by_the_solver_not_its_name(monkeypatch):
    from memplan.tasks.solve import SOLVERS, SolverSpec
    from memplan.tasks.solve.policy_solver import selective_policy

    monkeypatch.setitem(SOLVERS, "my-policy", SolverSpec("my-policy", selective_policy, "a copy.", policy_form=True))
    assert config(solver="my-policy").plans[0].plan_form == "policy"
    monkeypatch.setitem(SOLVERS, "my-policy", SolverSpec("my-policy", selective_policy, "a copy."))
    with pytest.raises(ConfigError, match="'my-policy' makes schedules selective checkpointing cannot run"):
        config(solver="my-policy", form="policy")


@pytest.mark.parametrize("key, value, shown", [("addresses", "greedy", 'addresses = "greedy"'),
                                                ("ddp_bucket_mb", 25, "ddp_bucket_mb = 25")])
def test_executor_settings_are_refused_in_the_policy_form(key, value, shown):
    with pytest.raises(ConfigError, match=rf"key plans\[0\]: plan of solver 'selective-policy' is in the policy form "
                                          rf"\(its solver's default\) and sets {shown}.*set form = \"executor\""):
        config(solver="selective-policy", **{key: value})
    assert config(solver="selective-policy", form="executor", **{key: value}).plans[0].plan_form == "executor"


def test_the_optimizer_inside_the_step_is_planned_in_the_policy_form():
    """runtime.apply takes the optimizer (post-accumulate-grad hooks), so the policy form plans it; it still
    refuses addresses with it, naming both keys."""
    plan = config(solver="selective-policy", optimizer_in_step=True).plans[0]
    assert plan.plan_form == "policy"
    assert plan.solve_settings("adamw").optimizer == "adamw" and plan.solve_settings("adamw").form == "policy"
    with pytest.raises(ConfigError, match=r"key plans\[0\]: plan of solver 'selective-policy' sets optimizer_in_step = "
                                          r"true with addresses = 'greedy'.*use addresses = \"none\""):
        config(solver="selective-policy", optimizer_in_step=True, addresses="greedy")


def test_an_unknown_form_lists_the_forms():
    with pytest.raises(ConfigError, match=r"key plans\[0\].form = 'eager': .*'executor', 'policy' or 'compiled'"):
        config(solver="selective-policy", form="eager")


def test_a_model_without_repeated_modules_is_refused_at_its_trace():
    from memplan.tasks.config import ModelConfig
    from memplan.tasks.models import ModelError
    from memplan.tasks.trace import capture_model

    spec = ModelConfig.model_validate(LINEAR)
    assert capture_model(spec, 8, "cpu", 0).meta.get("capture") is None      # the executor form needs none
    with pytest.raises(ModelError, match=r"model 'linear' at batch 8 has plans in the policy form .* records none .*"
                                         r"form = \"executor\""):
        capture_model(spec, 8, "cpu", 0, "policy")


def run_blocknet(tmp_path_factory, name: str, plans: str, top: str = ""):
    """`BLOCKNET_PIPELINE` with `plans` and `top` run once on BlockNet in a fresh folder: the folder and the
    run's outcomes."""
    from memplan.flows.plan import run_plan

    folder = tmp_path_factory.mktemp(name)
    (folder / "blocknet.py").write_text(BLOCKNET)
    (folder / "pipeline.toml").write_text(BLOCKNET_PIPELINE.format(top=top, plans=plans))
    return folder, run_plan(folder / "pipeline.toml")


@pytest.fixture(scope="module")
def project(tmp_path_factory, harness):
    """The pipeline run once on BlockNet: its folder and outcomes."""
    return run_blocknet(tmp_path_factory, "policy-project", PLANS)


def test_the_policy_plan_is_solved_on_the_eager_graph_and_published(project):
    from memplan.runtime.format.graph import OpGraph
    from memplan.runtime.format.plan import Plan
    from memplan.tasks.publish import read_index

    folder, outcomes = project
    assert {o["alias"]: (o["form"], o["status"]) for o in outcomes} == {
        "blocknet-b128-selective-policy-70pct": ("policy", "published"),
        "blocknet-b128-selective-policy-10pct": ("policy", "infeasible"),
        "blocknet-b128-checkpoint-all-100pct": ("executor", "published"),
        "blocknet-b128-selective-policy-75pct": ("policy", "published")}
    policy = Plan.load(folder / "plans" / "blocknet-b128-selective-policy-70pct.json")
    executor = Plan.load(folder / "plans" / "blocknet-b128-checkpoint-all-100pct.json")
    assert (policy.provenance["form"], policy.provenance["capture"]) == ("policy", "eager")
    assert "form" not in executor.provenance and "capture" not in executor.provenance
    graphs = {p.name: OpGraph.load(p) for p in (folder / ".cache" / "memplan" / "graphs").glob("*.json")}
    eager = {name: g for name, g in graphs.items() if "-eager-" in name}
    assert [g.fingerprint for g in eager.values()] == [policy.fingerprint]
    assert next(iter(eager.values())).meta["capture"] == "eager" and executor.fingerprint != policy.fingerprint
    assert len(policy.compute_steps()) > len(set(policy.compute_steps()))          # it recomputes something
    rows = {r["alias"]: r for r in read_index(folder / "plans")}
    assert rows["blocknet-b128-selective-policy-70pct"]["form"] == "policy"
    assert rows["blocknet-b128-checkpoint-all-100pct"]["form"] == "executor"
    row = rows["blocknet-b128-selective-policy-70pct"]
    assert row["measured_peak_bytes"] <= 1.05 * row["budget_bytes"] and row["predicted_peak_bytes"] <= row["budget_bytes"]


def test_a_compiled_cell_is_published_by_its_measured_search(project):
    """The pipeline runs the measured search for a cell solved compiled, between solve and validation: the published
    plan is the search's, its compiled peak (validation's, measured again) within the budget."""
    from memplan.runtime.format.plan import Plan

    folder, outcomes = project
    outcome = next(o for o in outcomes if o["alias"] == "blocknet-b128-selective-policy-75pct")
    plan = Plan.load(folder / "plans" / "blocknet-b128-selective-policy-75pct.json")
    search = plan.provenance["compiled_search"]
    assert outcome["compiled_peak_bytes"] == search["compiled_peak_bytes"] <= outcome["budget_bytes"]
    assert search["backend"] == "aot_eager" and 1 <= search["plans_measured"] <= 6
    assert plan.provenance["budget_bytes"] == outcome["budget_bytes"] and plan.provenance["compiled"] is True
    assert outcome["message"].startswith("measured search under torch.compile (backend 'aot_eager'")


def test_an_infeasible_policy_cell_cites_the_least_budget_its_own_solver_reaches(project):
    """The floor of a policy cell is found with selective-policy on the eager graph, not with the executor
    form's greedy probes (or executor plans' peaks) on another graph: solving there at it succeeds, below fails."""
    from memplan.tasks.problems import load_problem
    from memplan.tasks.solve import solve

    folder, outcomes = project
    infeasible = next(o for o in outcomes if o["alias"] == "blocknet-b128-selective-policy-10pct")
    floor = infeasible["least_feasible_bytes"]
    assert "least feasible budget this run knows" in infeasible["message"] and f"{floor:,} B" in infeasible["message"]
    graph, = (folder / ".cache" / "memplan" / "graphs").glob("*-eager-*.json")
    problem = load_problem(graph, device="cpu", store=folder / "profiles_db").problem
    assert solve(problem, "selective-policy", floor).feasible
    assert not solve(problem, "selective-policy", int(floor * 0.99)).feasible


def test_the_profile_flow_profiles_the_eager_graph_too(project):
    from memplan.flows.profile import run_profile

    folder, _ = project
    runs = run_profile(folder / "pipeline.toml", reuse=True)                # the plan flow's profiles, cached
    assert [(r["form"], r["fingerprint"] == policy_fingerprint(folder)) for r in runs] == [("executor", False),
                                                                                           ("policy", True)]


def policy_fingerprint(folder: Path) -> str:
    from memplan.runtime.format.plan import Plan

    return Plan.load(folder / "plans" / "blocknet-b128-selective-policy-70pct.json").fingerprint


def test_the_published_policy_plan_trains_like_eager_pytorch_in_a_plain_loop(project):
    from memplan import runtime
    from memplan.tasks.config import load_config
    from memplan.tasks.models import build_batch, build_model

    folder, _ = project
    sys.path.insert(0, str(folder))
    try:
        spec = load_config(folder / "pipeline.toml").models[0]
        model = build_model(spec, seed=0)
    finally:
        sys.path.remove(str(folder))
    batch = build_batch(spec, 128, seed=0, device="cpu")
    eager = copy.deepcopy(model)

    def loss_fn(m, x, y):
        return F.cross_entropy(m(x), y)

    planned = runtime.apply(folder / "plans" / "blocknet-b128-selective-policy-70pct.json", copy.deepcopy(model),
                            loss_fn, batch)
    for m in (eager, planned):
        torch.manual_seed(1)                                   # the same dropout masks for both
        loss_fn(m, *batch).backward()
    for (name, want), got in zip(eager.named_parameters(), planned.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-6, atol=1e-7, msg=name)
    assert any(hasattr(m, "_memplan_policy") for m in planned.modules())      # some blocks are checkpointed


def test_the_report_says_how_to_run_each_form(project):
    from memplan.flows.report import Outcome, loading_hint, markdown_table

    _, outcomes = project
    table = markdown_table([Outcome(**o) for o in outcomes])
    assert "| blocknet-b128-selective-policy-70pct | selective-policy | policy |" in table
    assert "| blocknet-b128-checkpoint-all-100pct | checkpoint-all | executor |" in table
    assert loading_hint({o["form"] for o in outcomes}) == (
        "executor plans, memplan.load(plan, model, loss_fn); policy plans, memplan.apply(plan, model, loss_fn, batch) "
        "in your own loop, then loss.backward() (docs/training.md)")


BN_BLOCKS = '''
from torch import nn


def bn_blocks(width=16, depth=4):
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, 4 * width), nn.BatchNorm1d(4 * width), nn.Tanh(),
                                         nn.Linear(4 * width, width)) for _ in range(depth)])
'''


def test_a_policy_plan_is_validated_the_way_it_runs(tmp_path, monkeypatch):
    """Under runtime.apply a checkpointed block's recomputation updates its BatchNorm statistics a second time
    (the executor form would not): validation runs the plan that way, so it finds the gradients equal and
    the buffers not."""
    from memplan.runtime.format.plan import graph_provenance
    from memplan.tasks.config import ModelConfig, ValidateConfig
    from memplan.tasks.solve import solve
    from memplan.tasks.solve.core.problem import Problem
    from memplan.tasks.solve.core.simulator import default_schedule, simulate
    from memplan.tasks.trace import capture_model
    from memplan.tasks.validate.stage import validate_alone

    (tmp_path / "bnnet.py").write_text(BN_BLOCKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = ModelConfig.model_validate({"name": "bn", "factory": "bnnet:bn_blocks", "loss": "mse",
                                       "inputs": [{"shape": [16]}, {"shape": [16]}]})
    graph = capture_model(spec, 128, "cpu", 0, "policy")
    problem = Problem.from_graph(graph)
    budget = int(0.7 * simulate(problem, default_schedule(problem)).peak_bytes)
    plan = solve(problem, "selective-policy", budget).to_plan(problem)
    plan.provenance.update(graph_provenance(graph))
    assert plan.form == "policy"
    validation = validate_alone(plan, spec, 128, "cpu", 0, ValidateConfig(steps=1, max_steps=1, warmup=0), graph=graph)
    assert not validation.passed and any(r.startswith("buffer:0.1.running_mean") for r in validation.reasons)
    assert not any(r.startswith(("loss", "grad:")) for r in validation.reasons), validation.reasons


def _scratch_backend(extra_bytes: int) -> str:
    """A torch.compile backend name: aot_eager, whose compiled forward and backward each also hold `extra_bytes` of
    scratch while they run (a compiler that keeps more than another)."""
    from torch._dynamo import list_backends, register_backend
    from torch._dynamo.backends.common import aot_autograd

    def holding(gm, example_inputs):
        def run(args):
            scratch = torch.empty(extra_bytes, dtype=torch.uint8)
            out = torch.fx.Interpreter(gm).boxed_run(args)       # aot_eager's boxed_nop, which frees inputs early
            del scratch
            return out
        run._boxed_call = True
        return run

    name = f"memplan_test_scratch_{extra_bytes}"
    if name not in list_backends(exclude_tags=()):
        register_backend(aot_autograd(fw_compiler=holding, bw_compiler=holding), name=name)
    return name


def test_a_compiled_policy_plan_is_validated_under_torch_compile_too(tmp_path, monkeypatch):
    """A policy plan solved with `compiled = true` (provenance `compiled`) is measured under torch.compile as well:
    validation records that peak (the same bytes `runtime.policy.compiled_peak` measures) and passes the plan where it is
    within the budget; a compiler that holds more (a backend with scratch as large as the budget) fails the same
    plan, naming the compiled check, while its eager peak still passes."""
    from memplan.runtime.policy.compiled_peak import compiled_peak
    from memplan.runtime.format.plan import graph_provenance
    from memplan.tasks.config import ModelConfig, ValidateConfig
    from memplan.tasks.models import build_batch, build_loss, build_model
    from memplan.tasks.solve import solve
    from memplan.tasks.solve.core.problem import Problem
    from memplan.tasks.solve.core.simulator import default_schedule, simulate
    from memplan.tasks.trace import capture_model
    from memplan.tasks.validate.stage import validate_alone

    (tmp_path / "blocknet.py").write_text(BLOCKNET)
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = ModelConfig.model_validate({"name": "blocknet", "factory": "blocknet:BlockNet",
                                       "inputs": [{"shape": [64]}, {"shape": [], "dtype": "int64", "high": 8}]})
    graph = capture_model(spec, 128, "cpu", 0, "policy")
    problem = Problem.from_graph(graph)
    solution = solve(problem, "selective-policy", int(0.7 * simulate(problem, default_schedule(problem)).peak_bytes))
    plan = solution.to_plan(problem)
    plan.provenance.update(graph_provenance(graph))
    plan.provenance["compiled"] = True
    batch = build_batch(spec, 128, seed=0, device="cpu")
    compiled = compiled_peak(plan, build_model(spec, seed=0), build_loss(spec), batch, graph=graph, backend="aot_eager")
    plan.provenance["budget_bytes"] = max(plan.provenance["budget_bytes"], compiled)
    settings = ValidateConfig(steps=1, max_steps=1, warmup=0, compile_backend="aot_eager")
    within = validate_alone(plan, spec, 128, "cpu", 0, settings, graph=graph)
    assert within.passed, within.reasons
    assert within.compiled_peak_bytes == compiled
    padded = settings.model_copy(update={"compile_backend": _scratch_backend(plan.provenance["budget_bytes"])})
    over = validate_alone(plan, spec, 128, "cpu", 0, padded, graph=graph)
    budget = plan.provenance["budget_bytes"]
    assert over.compiled_peak_bytes > 1.05 * budget >= over.measured_peak_bytes
    assert [r for r in over.reasons if not r.startswith("under torch.compile (backend 'memplan_test_scratch")] == []
    assert "plan with the measured search (tasks.compiled.policy_search)" in over.reasons[0]


def profiled_blocknet(tmp_path, monkeypatch):
    """BlockNet's spec and its graph captured for the policy form at batch 128, saved as tmp_path/graph.json and
    profiled once into the store at tmp_path."""
    from memplan.tasks.config import ModelConfig
    from memplan.tasks.profile.stage import ProfileSettings, profile_graph
    from memplan.tasks.trace import capture_model

    (tmp_path / "blocknet.py").write_text(BLOCKNET)
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = ModelConfig.model_validate({"name": "blocknet", "factory": "blocknet:BlockNet",
                                       "inputs": [{"shape": [64]}, {"shape": [], "dtype": "int64", "high": 8}]})
    graph = capture_model(spec, 128, "cpu", 0, "policy")
    graph.save(tmp_path / "graph.json")
    profile_graph(graph, "cpu", ProfileSettings(warmup=0, repeats=1, rounds=1), root=tmp_path, progress=False)
    return spec, graph


def test_the_solve_stage_marks_a_plan_solved_compiled(tmp_path, monkeypatch):
    """`options = { compiled = true }` is recorded in the plan's provenance, which validation reads."""
    from memplan.runtime.format.plan import Plan
    from memplan.tasks.config import Budget, PlanSettings
    from memplan.tasks.solve_stage import solve_case

    spec, graph = profiled_blocknet(tmp_path, monkeypatch)
    for params, marked in (({"compiled": True}, True), ({}, False)):
        solve_case(tmp_path / "graph.json", "selective-policy", Budget(fraction=0.7),
                   PlanSettings(form="policy", params=params), "cpu", str(tmp_path), str(tmp_path / "plan.json"))
        assert Plan.load(tmp_path / "plan.json").provenance.get("compiled", False) is marked


def test_a_compiled_cell_is_planned_by_its_measured_compiled_peak(tmp_path, monkeypatch):
    """A compiled cell's measured search (tasks/compiled/policy_cell.py) answers to the compiler the model trains with.
    Under a compiler that holds scratch while the forward and the backward run, the plan solved at the budget
    measures over it; the search's plan measures within it (measured again here), records what the search measured,
    and passes validation under that compiler, where its eager peak is judged by its prediction."""
    from memplan.runtime.policy.compiled_peak import compiled_peak
    from memplan.runtime.format.graph import OpGraph
    from memplan.runtime.format.plan import Plan, graph_provenance
    from memplan.runtime.policy.form import Regions, policy_schedule
    from memplan.tasks.compiled.policy_cell import search_cell
    from memplan.tasks.compiled.policy_search import COMPILED
    from memplan.tasks.config import Budget, PlanSettings, ValidateConfig
    from memplan.tasks.models import build_batch, build_loss, build_model
    from memplan.tasks.solve import solve
    from memplan.tasks.solve.core.problem import Problem
    from memplan.tasks.solve.core.simulator import simulate
    from memplan.tasks.solve_stage import solve_case
    from memplan.tasks.validate.stage import validate_alone

    spec, graph = profiled_blocknet(tmp_path, monkeypatch)
    settings = PlanSettings(form="policy", params={"compiled": True})
    solved = solve_case(tmp_path / "graph.json", "selective-policy", Budget(fraction=0.9), settings, "cpu",
                        str(tmp_path), str(tmp_path / "at-budget.json"))
    at_budget, budget = Plan.load(tmp_path / "at-budget.json"), solved.budget_bytes
    model, loss_fn, batch = build_model(spec, seed=0), build_loss(spec), build_batch(spec, 128, seed=0, device="cpu")
    problem = Problem.from_graph(OpGraph.load(tmp_path / "graph.json"))
    regions = Regions.of_graph(graph)
    whole = simulate(problem, policy_schedule(regions, {r: frozenset() for r in regions.members})).peak_bytes
    least = solve(problem, "selective-policy", whole, COMPILED).to_plan(problem)
    least.provenance.update(graph_provenance(graph))
    peaks = [compiled_peak(p, model, loss_fn, batch, graph=graph, backend="aot_eager") for p in (at_budget, least)]
    assert peaks[1] < peaks[0], peaks                   # the graph leaves the search room to go down
    scratch = _scratch_backend(max(0, budget - (peaks[0] + peaks[1]) // 2))
    assert compiled_peak(at_budget, model, loss_fn, batch, graph=graph, backend=scratch) > budget

    validate = ValidateConfig(steps=1, max_steps=1, warmup=0, compile_backend=scratch, compile_probes=8)
    searched = search_cell(tmp_path / "graph.json", solved, settings, spec, 128, "cpu", "cpu", 0, str(tmp_path),
                           validate, str(tmp_path / "searched.json"))
    plan = Plan.load(searched.plan_path)
    measured = compiled_peak(plan, model, loss_fn, batch, graph=graph, backend=scratch)
    assert measured <= budget and measured == plan.provenance["compiled_search"]["compiled_peak_bytes"]
    assert searched.feasible and searched.plan_id != solved.plan_id and searched.budget_bytes == budget
    assert plan.provenance["budget_bytes"] == budget and plan.provenance["compiled"] is True
    assert searched.measured_search.startswith("measured search under torch.compile")
    assert f"{measured:,} B" in searched.measured_search
    validation = validate_alone(plan, spec, 128, "cpu", 0, validate, graph=graph)
    assert validation.passed, validation.reasons
    assert validation.compiled_peak_bytes == measured


def test_the_prediction_bounds_a_policy_plans_measured_peak():
    from memplan.tasks.validate.stage import prediction_problem

    assert prediction_problem(1050, 1000, 0.05) is None
    assert prediction_problem(1051, 1000, 0.05) == (
        "measured peak 1,051 B exceeds the predicted 1,000 B by 5.1% (allowed 5.0%): autograd keeps more than the "
        "policy form predicts (runtime/policy/form.py: an op whose backward is several graph ops)")
    assert "no predicted.peak_bytes" in prediction_problem(10, None, 0.05)


def test_plans_apart_only_in_the_optimizer_inside_the_step_get_names_apart():
    """Each setting a plan runs with is in its name; two tables that differ otherwise and would make one
    name are refused, naming the tables and the keys, not one of them dropped."""
    data = {"models": [LINEAR], "optimizer": "adamw", "plans": [
        {"solver": "dtr", "budgets": [0.8]}, {"solver": "dtr", "budgets": [0.8], "optimizer_in_step": True},
        {"solver": "dtr", "budgets": [0.8], "ddp_bucket_mb": 25}]}
    assert [c.alias for c in expand_matrix(parse_config(data, "pipeline.toml"))] == [
        "linear-b8-dtr-80pct", "linear-b8-dtr-in-step-80pct", "linear-b8-dtr-ddp25mb-80pct"]
    data["plans"] = [{"solver": "dtr", "budgets": [0.8]}, {"solver": "dtr", "budgets": [0.8], "variants": "none"}]
    with pytest.raises(ConfigError, match=r"\[\[plans\]\] tables 1 and 2 \(solver 'dtr'\) both make plan "
                                          r"'linear-b8-dtr-80pct' but differ in other keys \(variants\)"):
        expand_matrix(parse_config(data, "pipeline.toml"))
