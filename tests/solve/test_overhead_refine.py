"""Plans by overhead, measured: the walk along the search's ladder corrects a predicted choice that the
measured step times contradict. The measured step time is a seam here: a schedule's cost under the *true*
operator costs, while the ladder is searched on a deliberately wrong profile (the pipeline test in
tests/pipeline/test_overhead_walk.py measures for real)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from memplan.tasks.validate.overhead import EXTRA_VALIDATIONS, MARGIN, Rung, predicted_choice, refine, written_rungs
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import default_schedule, simulate
from memplan.tasks.solve_stage import overhead_ladder


def uneven_linear_graph() -> Problem:
    """Checkmate's linear training graph of 4 layers with uneven costs and sizes (test_overhead_search.py's)."""
    n, size = 4, 9
    edges = [(i, i + 1) for i in range(size - 1)] + [(i, 2 * n - i) for i in range(n)]
    costs = [1.0, 4.0, 2.0, 6.0, 1.0, 3.0, 5.0, 2.0, 1.0]
    sizes = [30, 10, 50, 20, 4, 20, 50, 10, 30]
    return Problem.from_edges(costs, sizes, edges, backward=[i > n for i in range(size)], name="uneven4")


def walk_on_a_wrong_profile(node: int, factor: float, limit: float):
    """The ladder searched with node `node`'s cost scaled by `factor` in the profile, walked with the true costs
    as the measurement; returns the ladder's rungs, each rung's true overhead, the walk's result and the rungs
    it measured."""
    truth = uneven_linear_graph()
    cost = truth.cost.copy()
    cost[node] *= factor
    profiled = replace(truth, cost=cost)
    ladder = overhead_ladder(profiled, "checkmate", limit, simulate(profiled, default_schedule(profiled)), rel_tol=0.0)
    predicted_all = simulate(profiled, default_schedule(profiled)).compute_cost
    rungs = [Rung(s.objective / predicted_all - 1) for s in ladder.rungs]
    true_all = simulate(truth, default_schedule(truth)).compute_cost
    true_overhead = [simulate(truth, s.schedule).compute_cost / true_all - 1 for s in ladder.rungs]
    asked = []

    def measure(wanted):
        asked.extend(wanted)
        return [true_overhead[i] for _, i in wanted]

    start = predicted_choice(rungs, limit)
    (index, within, measured), = refine([(rungs, limit)], [true_overhead[start]], measure)
    return ladder, rungs, true_overhead, start, index, within, measured, asked


def test_a_choice_the_profile_underprices_steps_to_more_memory():
    """The profile prices node 1 at a tenth of its cost: the least-memory schedule looks +6.5% but costs +20%;
    the walk measures it above +10% and publishes the next rung up, the least-memory schedule truly within."""
    ladder, rungs, true, start, index, within, measured, asked = walk_on_a_wrong_profile(1, 0.1, 0.10)
    assert rungs[start].predicted_overhead <= 0.10 < true[start]          # the predicted-only choice is wrong
    assert within and true[index] <= 0.10 and index < start
    peaks = [s.predicted_peak_bytes for s in ladder.rungs]
    assert peaks[index] == min(p for p, t in zip(peaks, true) if t <= 0.10)
    assert set(measured) == {start, index} and len(asked) == 1


def test_a_choice_the_profile_overprices_steps_to_less_memory():
    """The profile prices node 0 at three times its cost: a schedule with less memory looks +11% (above the
    limit, within its margin) but costs +4%; the walk measures it and publishes it."""
    ladder, rungs, true, start, index, within, measured, asked = walk_on_a_wrong_profile(0, 3.0, 0.10)
    assert index > start and within and 0.10 < rungs[index].predicted_overhead <= 0.10 * (1 + MARGIN)
    assert true[index] <= 0.10
    assert ladder.rungs[index].predicted_peak_bytes < ladder.rungs[start].predicted_peak_bytes


def test_a_right_profile_changes_nothing():
    ladder, rungs, true, start, index, *_ = walk_on_a_wrong_profile(0, 1.0, 0.10)
    assert index == start and rungs[start].predicted_overhead == pytest.approx(true[start])


def synthetic(predicted: list[float]) -> list[Rung]:
    return [Rung(p) for p in predicted]


def test_the_walk_validates_the_margin_rungs_together_up_to_the_first_measured_above():
    rungs = synthetic([0.0, 0.05, 0.09, 0.11, 0.12, 0.14, 0.16])     # least memory last; limit 0.10, margin to 0.15
    true = [0.0, 0.04, 0.08, 0.095, 0.13, 0.09, 0.2]
    calls = []

    def measure(wanted):
        calls.append([i for _, i in wanted])
        return [true[i] for _, i in wanted]

    (index, within, measured), = refine([(rungs, 0.10)], [true[2]], measure)
    assert calls == [[3, 4, 5]]                 # every rung up to +15%, at once; rung 6 (+16%) is beyond the margin
    assert index == 5 and within                # rung 4 measured above, rung 5 (less memory still) within
    assert written_rungs(rungs, 0.10) == [0, 1, 2, 3, 4, 5]


def test_the_walk_is_bounded_and_publishes_the_least_measured_overhead_when_nothing_is_within():
    rungs = synthetic([0.0, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06])
    calls = []

    def measure(wanted):
        calls.append([i for _, i in wanted])
        return [0.5 - 0.01 * i for _, i in wanted]            # all above the limit, less so with less memory

    (index, within, measured), = refine([(rungs, 0.10)], [0.5 - 0.06], measure)
    assert calls == [[5], [4], [3]] and len(calls) == EXTRA_VALIDATIONS       # one rung up at a time, then stop
    assert not within and index == 6 and set(measured) == {3, 4, 5, 6}


def test_a_choice_that_fails_validation_is_not_walked_and_failed_rungs_are_never_published():
    rungs = synthetic([0.0, 0.05, 0.12])
    never = []
    (index, within, measured), = refine([(rungs, 0.10)], [None], lambda wanted: never.extend(wanted) or [])
    assert never == [] and index == 1 and not within and measured == {1: None}
    (index, within, _), = refine([(rungs, 0.10)], [0.02], lambda wanted: [None for _ in wanted])
    assert index == 1 and within                                 # rung 2 failed validation: the choice stays


def test_ladders_of_one_cell_are_walked_together():
    rungs = synthetic([0.0, 0.05, 0.12])
    calls = []

    def measure(wanted):
        calls.append(wanted)
        return [0.03 for _ in wanted]

    results = refine([(rungs, 0.10), (rungs, 0.25)], [0.03, 0.03], measure)
    assert calls == [[(0, 2)]]                   # the 25% ladder's choice is already its last rung
    assert [r[0] for r in results] == [2, 2]
