"""Plans by overhead, measured: the ladder a `max_overhead` search leaves, and the walk along it that validation
takes before a plan is published.

The budget search (`tasks.solve_stage.overhead_ladder`) keeps every schedule it solved on the way, as a ladder
ordered from most memory (least predicted overhead) to least memory, each rung strictly cheaper to run (by
prediction) than every rung with less memory. Its predicted choice is the least-memory rung whose *predicted*
overhead is within the limit. Predictions price each operator as the profile timed it alone, so a plan near
the limit can measure on either side of it; `refine` walks the ladder by *measured* overhead (against the
no-recomputation plan, timed in the same rounds):

- the predicted choice is validated first; when its measured overhead is above the limit, the next rung with
  more memory (less predicted overhead) is validated, one at a time;
- when a rung measures within the limit, the rungs with less memory whose predicted overhead is at most
  `limit * (1 + MARGIN)` are validated together (up to the number of validations left), as far as the first
  rung already measured above the limit;
- the published rung is the least-memory one measured within the limit; when none is (the bound spent), the
  one with the least measured overhead.

"Measured within" is the point estimate, the median over timed rounds of plan / no-recomputation - 1, at most
the limit: the upper end of the 95% interval would turn down nearly every plan near the limit on a busy host
(intervals up to 75 points wide were seen on 2 cores), the lower end would admit plans much slower than the
limit. A plan measured within is therefore within the limit plus its interval. `EXTRA_VALIDATIONS` bounds the
rungs validated after the predicted choice (validation is the expensive stage); a rung that fails validation
(results or peak) is never published. `memplan fit` walks its answer's ladder with the same `refine`, judged
by the interval's lower end instead (flows/fit_refine.py).

The no-recomputation plan lies beside the cell's plan (`no_recompute_path`); `no_recompute_beside` finds it for
a plan validated outside the plan flow (`memplan validate`), checking that it is one for that plan.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from memplan.runtime.format.plan import Plan, PlanError
from memplan.runtime.policy.form import FORM as POLICY
from memplan.tasks.records import Candidate, Solved

MARGIN = 0.5
"""Rungs predicted at most this fraction of the limit above it (0.10 -> up to +15%) are tried when a plan with
more memory measured within the limit."""

EXTRA_VALIDATIONS = 3
"""Rungs of one `max_overhead` cell validated beyond the predicted choice, at most."""


@dataclass(frozen=True)
class Rung:
    """A rung as the walk sees it: its predicted overhead over the no-recomputation schedule."""

    predicted_overhead: float


def predicted_choice(rungs: Sequence[Rung], limit: float) -> int:
    """The least-memory rung predicted within `limit` (the ladder's last such)."""
    within = [i for i, rung in enumerate(rungs) if rung.predicted_overhead <= limit + 1e-9]
    if not within:
        raise ValueError(f"no rung of the ladder is predicted within +{limit:.1%}")
    return within[-1]


def written_rungs(rungs: Sequence[Rung], limit: float, extra: int = EXTRA_VALIDATIONS) -> list[int]:
    """The rungs a walk can reach within `extra` validations after the predicted choice (the solve stage writes
    these as plans): the choice, up to `extra` rungs with more memory, up to `extra` with less within the
    margin."""
    start = predicted_choice(rungs, limit)
    more = list(range(max(0, start - extra), start))
    less = [i for i in range(start + 1, len(rungs)) if rungs[i].predicted_overhead <= limit * (1 + MARGIN)][:extra]
    return more + [start] + less


def next_rungs(rungs: Sequence[Rung], limit: float, measured: dict[int, float | None], left: int) -> list[int]:
    """The rungs to validate next given those `measured` so far (None: failed validation), at most `left`."""
    if left <= 0:
        return []
    passed = {i: m for i, m in measured.items() if m is not None}
    within = [i for i, m in passed.items() if m <= limit]
    if not within:                          # step to more memory, one rung at a time
        upward = [i for i in range(min(measured), -1, -1) if i not in measured]
        return upward[:1]
    best = max(within)
    stop = min((i for i, m in passed.items() if i > best and m > limit), default=len(rungs))
    return [i for i in range(best + 1, stop)
            if i not in measured and rungs[i].predicted_overhead <= limit * (1 + MARGIN)][:left]


def published_rung(limit: float, measured: dict[int, float | None]) -> tuple[int | None, bool]:
    """The rung to publish and whether it measured within `limit`: the least-memory rung measured within,
    else the passing rung of least measured overhead, else None."""
    passed = {i: m for i, m in measured.items() if m is not None}
    within = [i for i, m in passed.items() if m <= limit]
    if within:
        return max(within), True
    return (min(passed, key=passed.__getitem__), False) if passed else (None, False)


def refine(ladders: Sequence[tuple[Sequence[Rung], float]], first: Sequence[float | None],
           measure: Callable[[list[tuple[int, int]]], list[float | None]],
           extra: int = EXTRA_VALIDATIONS) -> list[tuple[int | None, bool, dict[int, float | None]]]:
    """Walk several ladders (each with its limit) of one model and batch size together: `first` is each
    predicted choice's measured overhead (None: failed validation); `measure` validates a list of (ladder,
    rung) pairs in one go (shared timing rounds) and returns their measured overheads. Returns per ladder the
    rung to publish, whether it measured within the limit, and every measured overhead. A ladder whose
    predicted choice failed validation is not walked: its failure is the cell's outcome."""
    states = []
    for (rungs, limit), measured in zip(ladders, first):
        states.append({predicted_choice(rungs, limit): measured})
    spent = [0] * len(ladders)
    while True:
        wanted = [(k, i) for k, ((rungs, limit), measured) in enumerate(zip(ladders, states))
                  if next(iter(measured.values())) is not None
                  for i in next_rungs(rungs, limit, measured, extra - spent[k])]
        if not wanted:
            break
        for (k, i), overhead in zip(wanted, measure(wanted)):
            states[k][i] = overhead
            spent[k] += 1
    results = []
    for (rungs, limit), measured in zip(ladders, states):
        if next(iter(measured.values())) is None:
            results.append((predicted_choice(rungs, limit), False, measured))
        else:
            results.append((*published_rung(limit, measured), measured))
    return results


def with_rung(solved: Solved, rung: Candidate) -> Solved:
    """`solved` with the ladder's `rung` as its plan (its arena size unknown here: None)."""
    return solved.model_copy(update=dict(
        plan_path=rung.plan_path, plan_id=rung.plan_id, budget_bytes=rung.budget_bytes,
        predicted_peak_bytes=rung.predicted_peak_bytes,
        objective=(1 + rung.predicted_overhead) * solved.checkpoint_all_cost, arena_bytes=None))


_RUNG = re.compile(r"-rung\d+$")
SETTINGS = ("optimizer_in_step", "ddp_bucket_mb")
"""The provenance a no-recomputation plan shares with the plans measured against it: how the executor runs them."""


def rung_path(plan_path: str | Path, index: int) -> str:
    """Where the solve stage writes rung `index` of a `max_overhead` cell's ladder: `<stem>-rung<index>.json`
    beside the cell's plan `<stem>.json`."""
    path = Path(plan_path)
    return str(path.with_name(f"{path.stem}-rung{index}.json"))


def no_recompute_path(plan_path: str | Path) -> str:
    """Where the solve stage writes a `max_overhead` cell's no-recomputation plan: beside the cell's plan
    `<stem>.json` as `<stem>-no-recompute.json`, shared by the cell's rungs (`<stem>-rung<i>.json`)."""
    path = Path(plan_path)
    return str(path.with_name(f"{_RUNG.sub('', path.stem)}-no-recompute.json"))


def no_recompute_beside(plan_path: str | Path, plan: Plan) -> tuple[Plan | None, str]:
    """The no-recomputation plan that `plan` (a `max_overhead` plan, read from `plan_path`) is measured against,
    from the file the solve stage wrote beside it, and its name; or None and why there is none to use."""
    if plan.form == POLICY:
        return None, "a policy-form plan's no-recomputation step is eager PyTorch's own"
    path = Path(no_recompute_path(plan_path))
    if not path.exists():
        return None, (f"there is no no-recomputation plan beside it ({path}; `memplan run` writes one beside each "
                      f"max_overhead cell's plan in its cache, a published plan has none)")
    try:
        other = Plan.load(path)
    except PlanError as exc:
        return None, f"its no-recomputation plan cannot be read ({exc})"
    computes = other.compute_steps()
    differs = [key for key in SETTINGS if other.provenance.get(key) != plan.provenance.get(key)]
    why = ("is of another graph" if other.fingerprint != plan.fingerprint else
           "recomputes" if len(computes) != len(set(computes)) else
           f"has another {' and '.join(differs)}" if differs else None)
    return (other, path.name) if why is None else (None, f"the plan beside it, {path}, {why}")
