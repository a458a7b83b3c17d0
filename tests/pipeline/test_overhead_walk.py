"""A `max_overhead` cell in the pipeline: its plan's overhead is measured against the no-recomputation plan in
the same rounds, and the walk along the search's ladder publishes the least-memory rung measured within the
limit. Measured for real on a small MLP whose profile is perturbed (forward operators priced at a hundredth of
their cost, so the search believes recomputing them is nearly free and its predicted choice tends to measure
above the limit); the step times are what they are, so the test asserts what the walk did with them, not what
they were (tests/solve/test_overhead_refine.py asserts the corrections on a cost model with wrong prices)."""

from __future__ import annotations

from dataclasses import replace

import pytest

PIPELINE = '''
device = "cpu"

[[models]]
name = "mlp"
factory = "walknet:mlp"
batch_sizes = [512]
inputs = [{ shape = [64] }, { shape = [], dtype = "int64", high = 4 }]

[profile]
warmup = 1
repeats = 2

[[plans]]
solver = "dtr"
max_overhead = 0.10

[validate]
steps = 6
max_steps = 6
warmup = 1
'''

WALKNET = '''
from torch import nn


def mlp(width=256, depth=6):
    layers = []
    for i in range(depth):
        layers += [nn.Linear(64 if i == 0 else width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 4))
'''


@pytest.fixture(scope="module")
def walked(tmp_path_factory, harness):
    """One run with a profile that underprices the forward pass; the Solved record and the walk's input and
    result, recorded on their way through the flow."""
    from memplan.flows import refine as refine_module
    from memplan.tasks import solve_stage
    from memplan.flows.plan import run_plan

    folder = tmp_path_factory.mktemp("walk")
    (folder / "walknet.py").write_text(WALKNET)
    (folder / "pipeline.toml").write_text(PIPELINE)
    seen: dict[str, list] = {"solved": [], "walks": []}
    real_load, real_solve, real_refine = (solve_stage.load_problem, solve_stage.solve_case,
                                          refine_module.refine)

    def underpriced(*args, **kwargs):
        loaded = real_load(*args, **kwargs)
        problem = loaded.problem
        cost = problem.cost.copy()
        cost[[i for i, phase in enumerate(problem.phase) if phase == "forward"]] /= 100
        return replace(loaded, problem=replace(problem, cost=cost))

    def solve_case(*args, **kwargs):
        seen["solved"].append(real_solve(*args, **kwargs))
        return seen["solved"][-1]

    def refine(ladders, first, measure, *args):
        result = real_refine(ladders, first, measure, *args)
        seen["walks"].append((ladders, result))
        return result

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(solve_stage, "load_problem", underpriced)
        patch.setattr(solve_stage, "solve_case", solve_case)
        patch.setattr(refine_module, "refine", refine)
        outcomes = run_plan(folder / "pipeline.toml")
    seen["folder"] = folder
    return outcomes, seen


def test_the_overhead_is_measured_against_the_no_recomputation_plan_and_reported(walked):
    from memplan.tasks.publish import read_index

    outcomes, seen = walked
    outcome, = outcomes
    solved, = seen["solved"]
    assert solved.no_recompute_path is not None and solved.candidates
    assert outcome["status"] == "published"
    low, high = outcome["overhead_vs_no_recompute_interval"]
    assert low <= outcome["overhead_vs_no_recompute"] <= high
    assert outcome["message"].startswith("measured walk: ")
    row, = read_index(seen["folder"] / "plans")                  # the index keeps what the limit was about
    assert (row["max_overhead"], row["overhead_vs_no_recompute"]) == (0.10, outcome["overhead_vs_no_recompute"])
    assert row["overhead_vs_no_recompute_interval"] == [low, high]


def test_the_walk_publishes_the_least_memory_rung_measured_within_the_limit(walked):
    """Whatever the timings: the walk starts at the predicted choice, steps to more memory while nothing it
    measured is within the limit and to less memory (within the margin) once something is, validates at most
    `EXTRA_VALIDATIONS` rungs more, and the run publishes the least-memory rung it measured within the limit
    (else the least measured overhead), reporting the overhead the walk judged."""
    from memplan.tasks.validate.overhead import EXTRA_VALIDATIONS, MARGIN, predicted_choice

    outcomes, seen = walked
    outcome, = outcomes
    solved, = seen["solved"]
    (ladders, ((index, within, measured),)), = seen["walks"]
    rungs, limit = ladders[0]
    start = predicted_choice(rungs, limit)
    assert solved.candidates[start].plan_id == solved.plan_id and start in measured
    assert 1 <= len(measured) <= 1 + EXTRA_VALIDATIONS and all(m is not None for m in measured.values())
    passed_within = [i for i, m in measured.items() if m <= limit]
    if measured[start] > limit:                                   # stepped up, nearest rung first
        assert len(measured) > 1 or start == 0
        upward = sorted((i for i in measured if i < start), reverse=True)
        assert upward == list(range(start - 1, start - 1 - len(upward), -1))
    else:                                                         # tried the margin rungs below
        assert all(i > start and rungs[i].predicted_overhead <= limit * (1 + MARGIN) for i in measured if i != start)
    if passed_within:
        assert within and index == max(passed_within)
    else:
        assert not within and index == min(measured, key=measured.get)
    rung = solved.candidates[index]
    assert outcome["plan_id"] == rung.plan_id and outcome["predicted_peak_bytes"] == rung.predicted_peak_bytes
    assert outcome["overhead_vs_no_recompute"] == pytest.approx(measured[index])
    assert outcome["measured_peak_bytes"] <= outcome["budget_bytes"] * 1.05
    assert outcome["message"].count("% measured ") == len(measured)


def test_a_policy_form_cell_writes_its_rungs_in_that_form_and_no_separate_no_recomputation_plan(tmp_path):
    """The policy form's no-recomputation step is eager PyTorch's (its overhead is judged against the reference
    step); its rungs are policy-form plans that `runtime.apply` accepts."""
    import torch
    from torch import nn

    from memplan.runtime.format.plan import Plan
    from memplan.runtime.policy.apply import capture_eager
    from memplan.tasks.config import Budget, PlanSettings
    from memplan.tasks.profile.stage import ProfileSettings, profile_graph
    from memplan.tasks.solve_stage import solve_case

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 32))
                                        for _ in range(3))

        def forward(self, x):
            for block in self.blocks:
                x = x + block(x)
            return x.square().mean()

    torch.manual_seed(0)
    graph = capture_eager(Net(), lambda model, x: model(x), (torch.randn(64, 32),))
    graph.save(tmp_path / "graph.json")
    profile_graph(graph, "cpu", ProfileSettings(warmup=0, repeats=1, rounds=1), root=tmp_path, progress=False)
    solved = solve_case(tmp_path / "graph.json", "selective-policy", Budget(max_overhead=10.0),
                        PlanSettings(form="policy"), "cpu", str(tmp_path), str(tmp_path / "plan.json"))
    assert solved.feasible and solved.no_recompute_path is None and len(solved.candidates) > 1
    assert solved.plan_id in [c.plan_id for c in solved.candidates]
    for rung in solved.candidates:
        plan = Plan.load(rung.plan_path)
        assert plan.provenance["form"] == "policy" and plan.provenance["max_overhead"] == 10.0
        assert plan.predicted["peak_bytes"] == rung.predicted_peak_bytes
