"""Compiled-form plans: the plan format's `compiled` key, loading one with `runtime.load`, and the measured search
that picks each budget's plan (tasks/compiled/plans.py)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from memplan import runtime
from memplan.runtime.compiled.records import Decision, RegionDecision
from memplan.runtime.compiled.step import CompiledPlanWarning, CompiledStep, PlannedDecide
from memplan.runtime.format.plan import Plan, PlanError
from memplan.tasks.compiled.form import FractionDecision
from memplan.tasks.compiled.plans import LEAST_FRACTION, RESOLUTION, CompiledModel, Probe

FINGERPRINT = "ab" * 32


def mlp_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x), y)


def test_a_compiled_plan_round_trips_and_names_its_form():
    region = RegionDecision(FINGERPRINT, Decision(frozenset({"mm_1", "relu"}), frozenset({"mm"})))
    plan = Plan(FINGERPRINT, [], provenance={"solver": "dtr", "budget_bytes": 10}, compiled=(region,))
    loaded = Plan.load(plan.to_json())
    assert loaded.form == "compiled" and loaded.compiled == (region,)
    assert plan.to_json()["compiled"] == [{"fingerprint": FINGERPRINT, "recompute": ["mm_1", "relu"], "save": ["mm"]}]


@pytest.mark.parametrize("compiled, schedule, words", [
    ([{"fingerprint": "xyz", "recompute": [], "save": []}], [], "64 lower-case hex"),
    ([{"fingerprint": FINGERPRINT, "recompute": ["a"], "save": ["a"]}], [], "both recomputes and saves"),
    ([{"fingerprint": FINGERPRINT, "recompute": [], "save": []}] * 2, [], "twice"),
    ([{"fingerprint": FINGERPRINT, "recompute": [3], "save": []}], [], "node names"),
    ([{"fingerprint": FINGERPRINT, "recompute": []}], [], "each is"),
    ({"fingerprint": FINGERPRINT}, [], "must be a list"),
    ([{"fingerprint": FINGERPRINT, "recompute": [], "save": []}], [{"compute": 0}], "empty schedule"),
])
def test_a_malformed_compiled_key_is_refused_with_its_reason(compiled, schedule, words):
    body = Plan(FINGERPRINT, []).to_json() | {"compiled": compiled, "schedule": schedule}
    body.pop("checksum")
    with pytest.raises(PlanError, match=words):
        Plan.load(body)


def test_planned_decide_answers_by_fingerprint_and_says_when_a_graph_is_unplanned():
    class Joint:
        fingerprint, nodes = "cd" * 32, ()

    decide = PlannedDecide((RegionDecision(FINGERPRINT, Decision(frozenset({"mm"}))),))
    with pytest.warns(CompiledPlanWarning, match="does not name"):
        assert decide(Joint()) == Decision()
    with pytest.raises(ValueError, match="Make a plan for this step"):
        PlannedDecide(decide.regions and (), unplanned="error")(Joint())


@pytest.fixture(scope="module")
def mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 128),
                          nn.Tanh(), nn.Linear(128, 4))
    return model, (torch.randn(512, 16), torch.randn(512, 4))    # activations outweigh the weights


def test_runtime_load_runs_a_compiled_plan_as_decided_with_eager_gradients(mlp):
    model, batch = mlp
    recorded = copy.deepcopy(model)
    step = CompiledStep(lambda *b: mlp_loss(recorded, *b), FractionDecision("dtr", 0.5))
    step(*batch).backward()
    cut, = step.partitioned
    plan = Plan(cut.fingerprint, [], provenance={"solver": "dtr", "budget_bytes": 1},
                compiled=(RegionDecision(cut.fingerprint, cut.decision),))
    assert cut.decision.recompute, "the decision at half the peak recomputes something"
    trained, eager = copy.deepcopy(model), copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompiledPlanWarning)          # the plan names the graph it compiles
        planned = runtime.load(plan, trained, mlp_loss)
        losses = [planned(*batch) for _ in range(2)]
    assert planned.compiled.partitioned[0].decision == cut.decision
    mlp_loss(eager, *batch).backward()
    mlp_loss(eager, *batch).backward()
    assert torch.allclose(losses[0], mlp_loss(model, *batch))
    for (name, p), q in zip(trained.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    with pytest.raises(ValueError, match="arena"):
        runtime.load(plan, trained, mlp_loss, arena=True)


class Curve(CompiledModel):
    """A compiled model whose measured peak is a given function of the fraction, and whose segment candidates
    `(stride, tail)` measure given `(peak, recompute cost)` (no compile)."""

    def __init__(self, peak, inductor: int, segments: dict | None = None) -> None:
        self.peak, self.probes, self.measured, self.segment_plans = peak, [], 0, segments or {}
        self.inductor = self._probe(None, inductor)

    def _probe(self, fraction, measured, segments=None, cost=0.0) -> Probe:
        decision = self._segment_decision(*segments) if segments is not None else Decision()
        probe = Probe(fraction, RegionDecision(FINGERPRINT, decision), measured, None, measured, 0.0, segments, cost)
        self.probes.append(probe)
        return probe

    def _segment_candidates(self):
        return list(self.segment_plans)

    def _segment_decision(self, stride, tail, lead):
        return Decision(frozenset({f"{stride}/{tail}/{lead}"})) if (stride, tail, lead) in self.segment_plans else None

    def _measure(self, fraction, segments=None):
        self.measured += 1
        if segments is not None:
            return self._probe(None, *self.segment_plans[segments][:1], segments, self.segment_plans[segments][1]), None
        return self._probe(fraction, int(self.peak(fraction))), None


curves = st.lists(st.integers(0, 400), min_size=8, max_size=8).map(
    lambda bumps: lambda f: 1000 + 1000 * f + bumps[min(7, int(f * 8))])


@settings(max_examples=60, deadline=None)
@given(curve=curves, budgets=st.lists(st.integers(900, 2600), min_size=1, max_size=4), probes=st.integers(1, 6))
def test_the_search_answers_within_each_budget_and_never_more_for_less(curve, budgets, probes):
    model = Curve(curve, inductor=2500)
    answers = {b: model.search(b, probes) for b in budgets}
    assert model.measured <= probes * len(budgets)
    for budget, answer in answers.items():
        if answer is not None:
            assert answer.measured_peak_bytes <= budget
    final = {b: model.best_within(b) for b in budgets}          # with every probe of the run measured
    for low in budgets:
        for high in budgets:
            if low < high and final[low] is not None:
                assert final[high] is not None and final[high].measured_peak_bytes <= high
                assert (final[high].fraction or 2) >= (final[low].fraction or 2)


def test_the_search_finds_the_least_recomputation_within_a_monotone_budget():
    model = Curve(lambda f: 1000 + 1000 * f, inductor=2100)
    found = model.search(1600, probes=12)
    assert found is not None and found.measured_peak_bytes <= 1600
    assert found.fraction >= 0.6 - RESOLUTION, "bisection ends within RESOLUTION of the best fraction"
    assert model.search(900, probes=12) is None and min(p.fraction or 2 for p in model.probes) >= LEAST_FRACTION


def test_segment_candidates_are_measured_once_where_no_solved_plan_fits_and_answer_by_least_recomputation():
    segments = {(1, 1, True): (700, 50.0), (1, 1, False): (750, 45.0), (1, 2, False): (800, 30.0)}
    model = Curve(lambda f: 1000 + 1000 * f, inductor=2100, segments=segments)
    assert model.search(1600, probes=6).segments is None
    assert not any(p.segments for p in model.probes), "a solved plan fits: no segment candidate is measured"
    answers = {budget: model.search(budget, probes=4) for budget in (900, 780, 720, 690)}
    assert sorted(p.segments for p in model.probes if p.segments) == sorted(segments), "each measured once"
    assert {b: a and a.segments for b, a in answers.items()} == {900: (1, 2, False), 780: (1, 1, False),
                                                                 720: (1, 1, True), 690: None}
    peaks = [answers[b].measured_peak_bytes for b in (900, 780, 720)]
    assert peaks == sorted(peaks, reverse=True), "a lower budget never gets a plan that measured more"
    assert Probe(None, RegionDecision(FINGERPRINT, Decision()), 1, None, 1, 0.0, (2, 1, False)).label == "segments 2/1"
    assert Probe(None, RegionDecision(FINGERPRINT, Decision()), 1, None, 1, 0.0, (1, 4, True)).label == \
        "segments 1/4 + lead"


def breaking_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    y = model(x)
    if y.sum() > 0:                              # a branch on a tensor's value: Dynamo breaks the graph here
        y = y * 2
    return y.square().mean()


def test_a_step_that_graph_breaks_is_refused_naming_where():
    from memplan.runtime.compiled.step import GraphBreakError

    model = nn.Linear(4, 4)
    with pytest.raises(GraphBreakError, match=r"test_compiled_plans.py:\d+: .*executor or policy form"):
        CompiledStep(lambda x: breaking_loss(model, x), FractionDecision("dtr", 0.5))(torch.randn(2, 4))
