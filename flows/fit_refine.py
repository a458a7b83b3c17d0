"""Plans by overhead, measured, in the `fit` flow: the answer's plan is validated beside its no-recomputation plan
and, when it measures over the limit beyond its 95% interval, the walk of tasks/validate/overhead.py steps to the
next rung of its ladder with more memory that still fits the device memory limit at the answer's size.

The plan flow publishes the least-memory rung whose median is within the limit; `fit` asks a different
question, whether its answer size holds at that overhead, so it keeps the predicted choice unless the
measurement rules it out (the lower end of the interval above the limit; the median where there is no interval,
under 6 rounds) and never walks to rungs with less memory: the answer already fits."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from memplan.tasks.config import ModelConfig, ValidateConfig
from memplan.tasks.fit.search import SizePoint
from memplan.tasks.fit.memory_limit import MemoryLimit
from memplan.tasks.validate.overhead import Rung, predicted_choice, refine
from memplan.tasks.records import Candidate, Validated

Validate = Callable[[list[str]], list[Validated]]
"""Validates plan files in shared rounds, each beside the answer's no-recomputation plan."""


@dataclass(frozen=True)
class MeasuredAnswer:
    """The plan `fit` answers with at its size (`plan_path`), its validation, and a line on the walk."""

    plan_path: str
    validation: Validated
    walk: str


def judged(validation: Validated) -> float | None:
    """The overhead the fit walk compares with the limit: the lower end of the 95% interval of the overhead the
    limit is about (the median without an interval); None for a plan that failed validation."""
    if not validation.passed:
        return None
    interval = validation.limited_interval()
    return validation.limited_overhead() if interval is None else interval[0]


def walk_answer(point: SizePoint, limit_bytes: int, max_overhead: float, validate: Validate) -> MeasuredAnswer:
    """Validate `point`'s predicted choice and walk its ladder upward by measured overhead (module doc), over the
    rungs whose predicted peak plus the resident bytes fits `limit_bytes`."""
    rungs = point.candidates                    # the predicted choice among them (`tasks.solve_stage.write_ladder`)
    choice = predicted_choice([Rung(c.predicted_overhead) for c in rungs], max_overhead)
    fitting = [i for i in range(choice + 1) if point.total(rungs[i].predicted_peak_bytes) <= limit_bytes]
    ladder = rungs[fitting[0]:choice + 1]        # the choice fits: the search chose it by this test
    records = {len(ladder) - 1: validate([ladder[-1].plan_path])[0]}

    def measure(wanted: list[tuple[int, int]]) -> list[float | None]:
        results = validate([ladder[i].plan_path for _, i in wanted])
        records.update({i: v for (_, i), v in zip(wanted, results)})
        return [judged(v) for v in results]

    (index, within, _), = refine([([Rung(c.predicted_overhead) for c in ladder], max_overhead)],
                                 [judged(records[len(ladder) - 1])], measure)
    return MeasuredAnswer(ladder[index].plan_path, records[index], walk_line(ladder, records, index, within))


def walk_line(ladder: list[Candidate], records: dict[int, Validated], index: int, within: bool) -> str:
    """What the walk validated (each rung's predicted step peak, resident bytes not included, and its predicted and
    measured overhead) and what it chose."""
    from memplan.flows.report import overhead_text

    seen = "; ".join(f"step peak {ladder[i].predicted_peak_bytes / 2**20:.2f} MiB, predicted {ladder[i].predicted_overhead:+.1%} "
                     f"measured {overhead_text(v.limited_overhead(), v.limited_interval()) if v.passed else 'failed'}"
                     for i, v in sorted(records.items()))
    if index == len(ladder) - 1 and within:
        return f"kept the predicted choice, not measured over the limit beyond its 95% interval ({seen})"
    if within:
        return (f"the predicted choice measured over the limit beyond its 95% interval; took the rung "
                f"{len(ladder) - 1 - index} up, with more memory, which was not ({seen})")
    return f"every rung validated that fits measured over the limit beyond its interval; the least overhead ({seen})"


def validate_answer(point: SizePoint, spec: ModelConfig, batch_size: int, device: str, seed: int,
                    settings: ValidateConfig, limit: MemoryLimit, max_overhead: float) -> MeasuredAnswer:
    """`walk_answer` with real validations: the reference step measured once under `limit` (in a temporary
    folder), each group of rungs validated against it in shared rounds beside the no-recomputation plan."""
    from memplan.runtime.format.plan import Plan
    from memplan.tasks.validate.reference import measure_reference
    from memplan.tasks.validate.stage import validate_plans

    baseline = None if point.no_recompute_path is None else Plan.load(point.no_recompute_path)
    with tempfile.TemporaryDirectory(prefix="memplan-fit-reference-") as folder:
        reference = measure_reference(spec, batch_size, device, seed, Path(folder) / "reference.safetensors",
                                      limit=limit)

        def validate(paths: list[str]) -> list[Validated]:
            return validate_plans([Plan.load(p) for p in paths], spec, batch_size, device, seed, settings, reference,
                                  limit=limit, no_recompute=[baseline] * len(paths))

        return walk_answer(point, limit.limit_bytes, max_overhead, validate)
