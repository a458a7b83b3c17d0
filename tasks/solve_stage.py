"""The solve stage: one solver at one budget on one loaded problem, and the plan it writes.

Plain functions: `memplan solve` calls `solve_loaded`, the pipeline's Prefect task (flows/steps.py)
calls `solve_case`, so both resolve budgets, run solvers, place addresses and fill plan predictions the
same way.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np

from memplan.runtime.format.graph import backend
from memplan.runtime.format.plan import Plan, graph_provenance, plan_id
from memplan.tasks.config import Addresses, Budget, MemplanError, PlanForm, PlanSettings
from memplan.tasks.problems import LoadedProblem, load_problem
from memplan.tasks.validate.overhead import MARGIN, Rung, no_recompute_path, rung_path, written_rungs
from memplan.tasks.records import Candidate, Solved
from memplan.tasks.solve import SOLVERS, solve
from memplan.tasks.solve.core.addresses import greedy_addresses
from memplan.tasks.solve.core.ddp import under_ddp
from memplan.tasks.solve.core.optimizer import in_step
from memplan.tasks.solve.olla import olla_addresses
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import Simulation, default_schedule, normalize_schedule, simulate
from memplan.tasks.solve.core.solution import Solution, SolveOptions, min_budget_lower_bound

PROBES = ("ap-greedy", "linearized-greedy")


def solve_loaded(loaded: LoadedProblem, solver: str, budget: Budget, options: SolveOptions,
                 addresses: Addresses = "none") -> tuple[Solution, Simulation]:
    """Resolve `budget` against the checkpoint-all peak (default order, no recomputation), run the
    solver, and with `addresses` "greedy" (largest first, best gap) or "olla" (OLLA's location ILP, within
    the same time limit) place the schedule's copies. Returns the solution and the checkpoint-all simulation."""
    problem = loaded.problem
    eager = simulate(problem, default_schedule(problem))
    if budget.max_overhead is not None:
        solution = least_memory_within(problem, solver, budget.max_overhead, eager, options)
    else:
        solution = solve(problem, solver, budget.resolve(eager.peak_bytes), options)
    return place_addresses(loaded, solution, options, addresses), eager


def place_addresses(loaded: LoadedProblem, solution: Solution, options: SolveOptions,
                    addresses: Addresses = "none") -> Solution:
    """`solution` with its copies placed in an arena by `addresses` ("none": as it is); the live peak stays."""
    if addresses == "none" or not solution.feasible:
        return solution
    problem = loaded.problem
    steps = in_place_steps(loaded, solution.schedule)
    placed = greedy_addresses(problem, solution.simulation, steps) if addresses == "greedy" else \
        olla_addresses(problem, solution.simulation, steps, time_limit=options.time_limit, gap=options.gap,
                       backend=options.backend, threads=options.threads).addresses
    return replace(solution, simulation=simulate(problem, solution.schedule, placed), addresses=placed)


@dataclass(frozen=True)
class VariantUse:
    """Implementation variant `impl` as a plan runs it on `nodes`, and whether the profile found it bit-identical
    to the default there (`exact`; None: not compared) on device `verified_on`."""

    impl: str
    nodes: list[int]
    exact: bool | None
    verified_on: str | None


def plan_of(loaded: LoadedProblem, solution: Solution, device: str | None) -> Plan:
    """The plan of a feasible solution, its provenance listing the variants it runs (`variant_uses`) and, for a
    captured graph, the rewrites and batch it was captured with (`graph_provenance`)."""
    plan = solution.to_plan(loaded.problem, device=device, profile_run_id=loaded.profile_run_id)
    plan.provenance["variants"] = [asdict(use) for use in variant_uses(loaded, plan.schedule)]
    if loaded.graph is not None:
        plan.provenance.update(graph_provenance(loaded.graph))
    return plan


def variant_uses(loaded: LoadedProblem, schedule: list) -> list[VariantUse]:
    """The non-default implementations a schedule runs, grouped by name and by the profile's `exact` verdict."""
    groups: dict[tuple[str, bool | None], set[int]] = {}
    for step in normalize_schedule(schedule):
        if "impl" in step:
            cost = None if loaded.costs is None else loaded.costs.variants[step["compute"]].get(step["impl"])
            groups.setdefault((step["impl"], None if cost is None else cost.exact), set()).add(step["compute"])
    return [VariantUse(impl, sorted(nodes), exact, loaded.device)
            for (impl, exact), nodes in sorted(groups.items(), key=lambda item: (item[0][0], str(item[0][1])))]


def in_place_steps(loaded: LoadedProblem, schedule: list) -> np.ndarray | None:
    """Schedule steps whose copies arena mode writes in place on the profiled device: default-implementation
    computes of the in-place nodes the graph recorded at capture (`runtime.tracing.facts`; None for benchmark graphs,
    which have no ops: all steps)."""
    if loaded.graph is None:
        return None
    nodes = loaded.graph.in_place_nodes(loaded.device or "cpu")
    steps = normalize_schedule(schedule)
    return np.array([s.get("compute") in nodes and "impl" not in s for s in steps], dtype=bool)


def load_cell_problem(graph_path: str | Path, settings: PlanSettings, device: str, store: str) -> LoadedProblem:
    """The problem a cell with the plan's `settings` is solved on: the graph priced by its newest complete profile on
    `device`, with the optimizer inside the step and DDP's buckets where the settings ask for them."""
    loaded = load_problem(graph_path, device=device, store=store, variants=settings.variants)
    if settings.optimizer != "none":
        foreach = backend(device) == "CUDA"            # torch.optim's default kernels there
        loaded = replace(loaded, problem=in_step(loaded.problem, loaded.graph.gradient_updates(), settings.optimizer,
                                                 foreach, each_alone=settings.form == "policy"))
    if settings.ddp_bucket_mb is not None:
        loaded = replace(loaded, problem=under_ddp(loaded.problem, loaded.graph.gradient_updates(), settings.ddp_bucket_mb))
    return loaded


def solve_case(graph_path: str | Path, solver: str, budget: Budget, settings: PlanSettings, device: str, store: str,
               plan_path: str) -> Solved:
    """Solve one cell of the pipeline matrix with the plan's `settings` against the graph's newest complete
    profile on `device`; when the solver finds a schedule, write its plan to `plan_path`."""
    loaded = load_cell_problem(graph_path, settings, device, store)
    options = settings.solve_options()
    candidates, baseline = [], None
    if budget.max_overhead is not None:
        eager = simulate(loaded.problem, default_schedule(loaded.problem))
        ladder = overhead_ladder(loaded.problem, solver, budget.max_overhead, eager, options)
        solution = place_addresses(loaded, ladder.chosen, options, settings.addresses)
    else:
        solution, eager = solve_loaded(loaded, solver, budget, options, settings.addresses)
    problem = loaded.problem
    lower = solution.min_budget_lower_bound or min_budget_lower_bound(problem)
    smallest = None
    if solution.feasible:
        plan = plan_of(loaded, solution, device)
        annotate(plan, budget, settings)
        plan.save(plan_path)
        if budget.max_overhead is not None:
            candidates, baseline = write_ladder(loaded, ladder, eager, budget, settings, device, plan_path, plan)
    elif eager.peak_bytes > solution.budget_bytes:
        probes = (solver,) if settings.form == "policy" else PROBES     # the policy form's own floor
        smallest = smallest_feasible_budget(problem, max(lower, solution.budget_bytes), eager.peak_bytes, probes=probes)
    return Solved(
        solver=solver,
        status=solution.status,
        feasible=solution.feasible,
        budget_bytes=solution.budget_bytes,
        checkpoint_all_peak_bytes=eager.peak_bytes,
        checkpoint_all_cost=eager.compute_cost,
        predicted_peak_bytes=solution.predicted_peak_bytes,
        arena_bytes=None if solution.simulation is None else solution.simulation.arena_bytes,
        objective=solution.objective,
        gap=solution.gap,
        solve_seconds=solution.solve_seconds,
        backend=solution.backend,
        min_budget_lower_bound=lower,
        smallest_feasible_budget=smallest,
        message=solution.message,
        plan_path=plan_path if solution.feasible else None,
        plan_id=plan_id(plan) if solution.feasible else None,
        profile_run_id=loaded.profile_run_id,
        max_overhead=budget.max_overhead,
        candidates=candidates,
        no_recompute_path=None if baseline is None else no_recompute_path(plan_path),
        no_recompute_id=None if baseline is None else plan_id(baseline),
    )


def annotate(plan: Plan, budget: Budget, settings: PlanSettings) -> None:
    """Record the cell's overhead limit, optimizer inside the step, DDP buckets, form and whether the model trains
    compiled (`selective-policy`'s `compiled` option, which validation checks under torch.compile) in the plan's
    provenance."""
    if settings.params.get("compiled") is True:
        plan.provenance["compiled"] = True
    if budget.max_overhead is not None:
        plan.provenance["max_overhead"] = budget.max_overhead
    if settings.optimizer != "none":
        plan.provenance["optimizer_in_step"] = settings.optimizer
    if settings.ddp_bucket_mb is not None:
        plan.provenance["ddp_bucket_mb"] = settings.ddp_bucket_mb
    _record_form(plan, settings.form)


def write_ladder(loaded: LoadedProblem, ladder: Ladder, eager: Simulation, budget: Budget, settings: PlanSettings,
                 device: str, plan_path: str, chosen: Plan) -> tuple[list[Candidate], Plan | None]:
    """What a measured walk of a `max_overhead` search's `ladder` needs, written beside its predicted choice
    `chosen` (saved at `plan_path`): the rungs it can reach (`_candidates`) and the no-recomputation plan it
    measures them against (`no_recompute_path`; None in the policy form, whose no-recomputation step is eager
    PyTorch's). `eager`: the checkpoint-all simulation."""
    candidates = _candidates(loaded, ladder, eager, budget, settings, device, plan_path, chosen)
    if settings.form == "policy":
        return candidates, None
    baseline = plan_of(loaded, solve(loaded.problem, "checkpoint-all", eager.peak_bytes), device)
    annotate(baseline, Budget(fraction=1.0), settings)
    baseline.save(no_recompute_path(plan_path))
    return candidates, baseline


def _candidates(loaded: LoadedProblem, ladder: Ladder, eager: Simulation, budget: Budget, settings: PlanSettings,
                device: str, plan_path: str, chosen: Plan) -> list[Candidate]:
    """The rungs of `ladder` a measured walk can reach (`written_rungs`), each written as a plan beside
    `plan_path` (the predicted choice's own, `chosen`), most memory first."""
    rungs = [Rung(s.objective / eager.compute_cost - 1) for s in ladder.rungs]
    candidates = []
    for index in written_rungs(rungs, budget.max_overhead):
        solution = ladder.rungs[index]
        if solution is ladder.chosen:
            path, plan = plan_path, chosen
        else:
            plan = plan_of(loaded, place_addresses(loaded, solution, settings.solve_options(), settings.addresses),
                           device)
            annotate(plan, budget, settings)
            path = rung_path(plan_path, index)
            plan.save(path)
        candidates.append(Candidate(plan_path=path, plan_id=plan_id(plan), budget_bytes=solution.budget_bytes,
                                    predicted_peak_bytes=solution.predicted_peak_bytes,
                                    predicted_overhead=rungs[index].predicted_overhead))
    return candidates


def _record_form(plan: Plan, form: PlanForm) -> None:
    """Record the `[[plans]]` form in the plan's provenance: "policy" (runtime.apply runs it; made on
    capture_eager's graph, whose `capture = "eager"` graph_provenance copied), or none for the executor form,
    also where the solver makes policy-form schedules (made on the executor's graph, only runtime.load runs it)."""
    if form == "policy":
        if plan.provenance.get("capture") != "eager":
            raise MemplanError(f"a plan in the policy form was solved on a graph not captured as eager PyTorch runs "
                               f"it (provenance capture = {plan.provenance.get('capture')!r}); trace it with "
                               f"runtime.policy.apply.capture_eager (the trace stage does for form = \"policy\").")
        plan.provenance["form"] = form
    else:
        plan.provenance.pop("form", None)


def smallest_feasible_budget(problem: Problem, infeasible: int, feasible: int, rel_tol: float = 0.005,
                             probes: tuple[str, ...] = PROBES) -> int:
    """The smallest budget, within `rel_tol`, between one known infeasible and one known feasible (the
    checkpoint-all peak) at which one of the fast solvers `probes` (greedy baselines; for a policy-form plan,
    its own solver) finds a schedule."""
    probes = [name for name in probes if name in SOLVERS]

    def least_peak(budget: int) -> int | None:
        return min((s.predicted_peak_bytes for s in (solve(problem, name, budget) for name in probes) if s.feasible),
                   default=None)

    return bisect_budget(infeasible, feasible, least_peak, rel_tol) if probes else feasible


def bisect_budget(rejected: int, accepted: int, probe: Callable[[int], int | None], rel_tol: float = 0.005) -> int:
    """Bisection between a budget `rejected` and one `accepted` by `probe`, which returns the peak (at most
    the budget) of a schedule it accepts at a budget, or None: the least accepted peak seen once the two
    ends are within `rel_tol` of `accepted` (or 1 byte)."""
    while accepted - rejected > max(1.0, rel_tol * accepted):
        middle = (rejected + accepted) // 2
        peak = probe(middle)
        if peak is None:
            rejected = middle
        else:
            accepted = min(accepted, peak)
    return accepted


@dataclass(frozen=True)
class Ladder:
    """What a `max_overhead` search found: `chosen`, the least-peak schedule predicted within the limit (or a
    Solution without a schedule saying why there is none), and `rungs`, the schedules it solved on the way that
    no other beats on both peak and predicted cost, most memory first (`chosen` among them):
    tasks/validate/overhead.py walks them by measured overhead."""

    chosen: Solution
    rungs: list[Solution]


def overhead_ladder(problem: Problem, solver: str, max_overhead: float, eager: Simulation,
                    options: SolveOptions | None = None, rel_tol: float = 0.005) -> Ladder:
    """The least-peak schedule `solver` finds whose predicted cost is at most (1 + `max_overhead`) x the cost of
    `eager`, the checkpoint-all simulation: a search on the budget (`limit_search`, within `rel_tol`) between the
    lower bound `min_budget_lower_bound` and the checkpoint-all peak, each solve told what the search needs
    (`SolveOptions`: `enough`, any schedule within the limit; `cost_limit`, none above the rungs a measured walk
    may try, `tasks.validate.overhead.MARGIN`; one `memo` for all); and the ladder of every schedule it solved
    (those above the limit included). When even its schedule at the checkpoint-all peak costs more, the chosen
    Solution has no schedule and says so."""
    limit = (1 + max_overhead) * eager.compute_cost * (1 + 1e-12)      # float sums of the same costs
    hinted = replace(options or SolveOptions(), enough=limit, memo={},
                     cost_limit=(1 + max_overhead * (1 + MARGIN)) * eager.compute_cost * (1 + 1e-12))
    seen: dict[int, Solution] = {}

    def probe(budget: int) -> tuple[int, float]:
        solution = solve(problem, solver, budget, hinted)
        if not solution.feasible:                # none within cost_limit: its cost is at least that
            return budget, hinted.cost_limit
        seen.setdefault(solution.predicted_peak_bytes, solution)
        return solution.predicted_peak_bytes, solution.objective

    top = probe(eager.peak_bytes)
    if top[1] > limit:
        at_top = solve(problem, solver, eager.peak_bytes, options)
        found = (f"its schedule there costs {at_top.objective / eager.compute_cost - 1:+.1%}" if at_top.feasible
                 else f"it finds no schedule there ({at_top.status})")
        return Ladder(Solution(solver, eager.peak_bytes, "no_solution", message=(
            f"no schedule within +{max_overhead:.0%} predicted overhead: even at the checkpoint-all peak {found}")), [])
    lower = min_budget_lower_bound(problem)
    chosen = seen[limit_search(min(lower, top[0]) - 1, top, probe, limit, rel_tol)]
    front: list[Solution] = []
    for peak in sorted(seen):                # least peak first: keep a rung only if it costs less than all below
        if not front or seen[peak].objective < front[-1].objective:
            front.append(seen[peak])
    return Ladder(chosen, front[::-1])


def limit_search(rejected: int, top: tuple[int, float], probe: Callable[[int], tuple[int, float] | None],
                 limit: float, rel_tol: float = 0.005) -> int:
    """The least peak of a schedule costing at most `limit` that `probe` (a budget -> the peak, at most the budget,
    and the cost of the schedule it finds, or None) finds at some budget between `rejected`, where it finds none
    within the limit, and `top`'s peak (`top`: its answer at the checkpoint-all peak), once the two ends are within
    `rel_tol` of the least (or 1 byte). Like `bisect_budget`, but each probe aims at the budget where the cost,
    interpolated linearly in 1 / budget between the answers (`_crossing`: a schedule within the limit at its peak,
    one above it at the budget probed; extrapolated from schedules within it no further than bisection would go),
    meets the limit: half a tolerance
    below it after a probe that found one within the limit and above it after one that did not, so that two probes
    close the bracket once the interpolation is right, the offset doubling while probes keep landing on the same
    side (schedules' peaks move in steps); bisection where it cannot interpolate or after `SAME_SIDE` such probes."""
    accepted, found = top[0], [top]
    last_within, same = True, 0
    while accepted - rejected > max(1.0, rel_tol * accepted):
        tol = max(1.0, rel_tol * accepted)
        guess, middle = _crossing(found, limit, accepted), (rejected + accepted) // 2
        if guess is None or same >= SAME_SIDE:
            budget = middle
        else:
            if all(cost <= limit for _, cost in found):      # extrapolated: no further than bisection goes
                guess = max(guess, middle)
            guess, offset = min(max(guess, rejected), accepted), tol / 2 * 2 ** same
            budget = round(guess - offset if last_within else guess + offset)
            budget = max(min(budget, accepted - math.floor(tol)), rejected + 1)     # a miss there ends the search
        answer = probe(budget)
        within = answer is not None and answer[1] <= limit
        if answer is not None:
            found.append(answer if within else (budget, answer[1]))      # the cost at this budget
        if within:
            accepted = min(accepted, answer[0])
        else:
            rejected = budget
        same = same + 1 if within == last_within else 0
        last_within = within
    return accepted


SAME_SIDE = 4
"""Probes landing on the same side of the limit in a row after which `limit_search` bisects."""


def _crossing(found: list[tuple[int, float]], limit: float, accepted: int) -> float | None:
    """The peak where the cost meets `limit`, linear in 1 / peak through the least-peak schedule within the limit
    and the largest-peak one above it (under `accepted`), else the two least-peak ones within it (extrapolated);
    None where neither pair slopes."""
    within = sorted({(peak, cost) for peak, cost in found if cost <= limit})
    above = [(peak, cost) for peak, cost in found if cost > limit and peak < accepted]
    if above:
        pair = [within[0], max(above)]
    elif len(within) >= 2 and within[0][0] < within[1][0] and within[0][1] > within[1][1]:
        pair = within[:2]
    else:
        return None
    (p0, c0), (p1, c1) = pair
    if c0 == c1 or min(p0, p1) <= 0:
        return None
    inverse = 1 / p0 + (limit - c0) * (1 / p1 - 1 / p0) / (c1 - c0)
    return 1 / inverse if inverse > 0 else 0.0


def least_memory_within(problem: Problem, solver: str, max_overhead: float, eager: Simulation,
                        options: SolveOptions | None = None, rel_tol: float = 0.005) -> Solution:
    """The predicted choice of `overhead_ladder`: the least-peak schedule predicted within the limit."""
    return overhead_ladder(problem, solver, max_overhead, eager, options, rel_tol).chosen
