"""`memplan fit`'s answer by measured overhead (flows/fit_refine.py): the walk up the answer's ladder on exact
small cases, with validations given (no timing)."""

from __future__ import annotations

from memplan.flows.fit_refine import walk_answer
from memplan.tasks.fit.search import SizePoint
from memplan.tasks.records import Candidate, Validated

LIMIT = 0.10
# most memory first: rung0 and rung1 are predicted within nothing but eager's cost, rung3 is the predicted
# choice (the least memory within +10%), rung4 is over the limit by prediction
PEAKS = [900, 700, 600, 500, 400]
PREDICTED = [0.0, 0.02, 0.05, 0.09, 0.14]


def point(limit_bytes: int = 10_000) -> SizePoint:
    rungs = [Candidate(plan_path=f"rung{i}.json", plan_id=f"{i}" * 64, budget_bytes=peak, predicted_peak_bytes=peak,
                       predicted_overhead=overhead) for i, (peak, overhead) in enumerate(zip(PEAKS, PREDICTED))]
    return SizePoint(size=8, batch_size=8, resident_bytes=100, eager_peak_bytes=1000, checkpoint_peak_bytes=None,
                     memplan_peak_bytes=500, memplan_overhead=0.09, plan_path="rung3.json", candidates=rungs,
                     no_recompute_path="no-recompute.json")


def validation(overhead: float | None, interval: list[float] | None) -> Validated:
    """A validation whose overhead against the no-recomputation plan is `overhead` (None: failed validation)."""
    return Validated(plan_id="0" * 64, passed=overhead is not None, reasons=[] if overhead is not None else ["loss differs"],
                     device="cpu", device_name="cpu", budget_bytes=0, predicted_peak_bytes=0, measured_peak_bytes=0,
                     eager_peak_bytes=0, measured_step_ms=1.0, eager_step_ms=1.0, overhead=0.0, loss=0.0,
                     eager_loss=0.0, max_abs_error=0.0, tensors_compared=1, no_recompute_step_ms=1.0,
                     overhead_vs_no_recompute=overhead or 0.0, overhead_vs_no_recompute_interval=interval)


def validator(measured: dict[str, Validated]):
    calls = []

    def validate(paths):
        calls.append(list(paths))
        return [measured[p] for p in paths]

    return validate, calls


def test_a_choice_measured_within_the_limit_is_the_answer():
    validate, calls = validator({"rung3.json": validation(0.08, [0.05, 0.11])})
    answer = walk_answer(point(), 10_000, LIMIT, validate)
    assert (answer.plan_path, calls) == ("rung3.json", [["rung3.json"]])
    assert answer.walk.startswith("kept the predicted choice")


def test_a_choice_over_the_limit_beyond_its_interval_steps_to_more_memory():
    validate, calls = validator({"rung3.json": validation(0.20, [0.15, 0.25]), "rung2.json": validation(0.12, [0.06, 0.18])})
    answer = walk_answer(point(), 10_000, LIMIT, validate)
    assert calls == [["rung3.json"], ["rung2.json"]]             # within its interval: no further
    assert answer.plan_path == "rung2.json" and answer.validation.overhead_vs_no_recompute == 0.12
    assert "took the rung 1 up" in answer.walk


def test_a_choice_over_the_limit_only_by_its_median_stays():
    validate, calls = validator({"rung3.json": validation(0.13, [0.04, 0.30])})
    assert walk_answer(point(), 10_000, LIMIT, validate).plan_path == "rung3.json" and len(calls) == 1


def test_the_walk_never_takes_a_rung_that_does_not_fit_the_limit():
    measured = {f"rung{i}.json": validation(0.16 + i / 100, [0.13 + i / 100, 0.21 + i / 100]) for i in range(4)}
    validate, calls = validator(measured)
    answer = walk_answer(point(), 100 + 600, LIMIT, validate)   # resident 100 B + rung2's 600 B fit, rung1's 700 do not
    assert calls == [["rung3.json"], ["rung2.json"]]
    assert answer.plan_path == "rung2.json"                      # the least measured of those validated (+18%)
    assert answer.walk.startswith("every rung validated that fits measured over the limit")


def test_a_choice_that_fails_validation_is_the_answer_and_is_not_walked():
    validate, calls = validator({"rung3.json": validation(None, None)})
    answer = walk_answer(point(), 10_000, LIMIT, validate)
    assert answer.plan_path == "rung3.json" and not answer.validation.passed and calls == [["rung3.json"]]
