"""Plans by overhead, measured, in the `plan` flow: after the first validation of a run, each `max_overhead`
cell walks its ladder by measured overhead (tasks/validate/overhead.py) and publishes the rung the walk chose.
The rungs of one model and batch size are validated together, beside their no-recomputation plans."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from memplan.tasks.config import Case, ModelConfig
from memplan.tasks.validate.overhead import Rung, predicted_choice, refine, with_rung
from memplan.tasks.records import Candidate, Solved, StageError, Validated

Cell = tuple[str, int]


@dataclass(frozen=True)
class PlanToValidate:
    """A plan file to validate and the no-recomputation plan its overhead is measured against (None: none)."""

    plan_path: str
    plan_id: str
    no_recompute_path: str | None = None
    no_recompute_id: str | None = None

    @classmethod
    def of(cls, solved: Solved, candidate: Candidate | None = None) -> PlanToValidate:
        """The solved cell's plan, or its rung `candidate`."""
        path, pid = (solved.plan_path, solved.plan_id) if candidate is None else (candidate.plan_path, candidate.plan_id)
        return cls(path, pid, solved.no_recompute_path, solved.no_recompute_id)


Validate = Callable[[dict[Cell, list[tuple[ModelConfig, PlanToValidate]]]], dict[Cell, list[Validated | StageError]]]
"""Validates groups of plans, one per model and batch size; a plan that raised gets its `StageError`."""


def measured_choices(cases: list[Case], solutions: list[Solved], validations: dict[str, Validated | StageError],
                     validate: Validate) -> tuple[list[Solved], dict[str, Validated | StageError], dict[str, str]]:
    """Walk the ladder of every validated `max_overhead` cell (not one whose validation raised), the cells of one
    model and batch size together (`validate` validates groups of plans, one call per cell per step of the walks).
    Returns the solutions with each walked cell's chosen rung in place of its predicted choice, the validations
    likewise (a cell a rung of whose walk raised: that rung's `StageError`, stage "measured walk"), and per walked
    alias a line saying what the walk validated."""
    solutions, validations = list(solutions), dict(validations)
    walked: dict[Cell, list[int]] = {}
    for k, (case, solved) in enumerate(zip(cases, solutions)):
        if case.budget.max_overhead is not None and solved.candidates and \
                isinstance(validations.get(case.alias), Validated):
            walked.setdefault((case.model.name, case.batch_size), []).append(k)
    walks = {}
    for cell, members in walked.items():
        ladders = [([Rung(c.predicted_overhead) for c in solutions[k].candidates], cases[k].budget.max_overhead)
                   for k in members]
        first = [_measured(validations[cases[k].alias]) for k in members]
        records: dict[tuple[int, int], Validated | StageError] = {}

        def measure(wanted: list[tuple[int, int]]) -> list[float | None]:
            group = [(cases[members[j]].model, PlanToValidate.of(solutions[members[j]],
                                                                 solutions[members[j]].candidates[i]))
                     for j, i in wanted]
            results = validate({cell: group})[cell]
            records.update(zip(wanted, results))
            return [_measured(v) for v in results]

        for j, (index, within, measured) in enumerate(refine(ladders, first, measure)):
            k = members[j]
            solved, case = solutions[k], cases[k]
            start = predicted_choice(*ladders[j])
            raised = [r for (rung_of, _), r in sorted(records.items()) if rung_of == j and isinstance(r, StageError)]
            if raised:                                   # the cell fails with the first rung's error
                validations[case.alias] = raised[0].model_copy(update={"stage": "measured walk"})
                continue
            if index is not None and index != start:
                solutions[k] = with_rung(solved, solved.candidates[index])
                validations[case.alias] = records[j, index]
            walks[case.alias] = walk_text(solved.candidates, start, index, within, measured)
    return solutions, validations, walks


def _measured(validation: Validated | StageError) -> float | None:
    """The overhead a walk judges (None: the plan failed validation, or raised)."""
    return validation.limited_overhead() if isinstance(validation, Validated) and validation.passed else None


def walk_text(rungs: list[Candidate], start: int, index: int | None, within: bool,
              measured: dict[int, float | None]) -> str:
    """One line on a walk: the rungs it validated (predicted -> measured overhead) and the one it chose."""
    seen = ", ".join(f"{rungs[i].predicted_peak_bytes / 2**20:.1f} MiB predicted {rungs[i].predicted_overhead:+.1%} "
                     f"measured {'failed' if m is None else f'{m:+.1%}'}" for i, m in sorted(measured.items()))
    if index is None:
        return f"measured walk: no rung passed validation ({seen})"
    verdict = "within the limit" if within else "none measured within the limit; the least measured overhead"
    moved = "the predicted choice" if index == start else f"rung {index} of {len(rungs)}, not the predicted choice"
    return f"measured walk: published {moved} ({verdict}); validated {seen}"
