"""`monet` and `monet-noop`: MONeT's program (model.py) solved on the shared MILP backends.

`monet` chooses checkpoints and every node's implementation variant jointly; `monet-noop` is the same
program on the problem without variants (the paper's MONeT-NoOp). Both start from a cheaper solver's
schedule when it fits and lies in MONeT's space (`warm_start`: checkpoint-all, else hierarchical, else
ap-greedy) and return it when the MILP finds nothing better in its time. `monet` on a problem with
variants starts from `monet-noop`'s answer instead (solved in a third of the time): MONeT-NoOp's program
is MONeT's with every node held to its default, so its schedule always seeds MONeT's MILP and `monet`
ends no worse than `monet-noop` did.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Iterator, Literal

from memplan.tasks.solve.core.milp import MilpOptions, Progress, solve_milp
from memplan.tasks.solve.monet.decode import complete_start, integer_assignment, schedule_from_solution
from memplan.tasks.solve.monet.model import build_model
from memplan.tasks.solve.core.problem import Problem, ProblemError
from memplan.tasks.solve.core.simulator import InvalidSchedule, default_schedule, simulate
from memplan.tasks.solve.core.solution import Solution, SolveOptions, checked_solution, min_budget_lower_bound

log = logging.getLogger("memplan.solve")


@dataclass(frozen=True)
class MonetOptions:
    """Options of `monet` and `monet-noop`."""

    warm_start: Literal["auto", "checkpoint-all", "monet-noop", "hierarchical", "ap-greedy", "none"] = field(
        default="auto", metadata={
            "help": "solver whose schedule starts the MILP when it fits the budget and lies in MONeT's space "
                    "(forward pass once, recomputations before backward nodes); 'auto': checkpoint-all when it "
                    "fits, else for `monet` on a problem with variants monet-noop (in a third of the time limit), "
                    "else hierarchical (its Checkmate blocks), else ap-greedy; SolveOptions.mip_start wins."})


NOOP_SHARE = 1 / 3
"""Share of `monet`'s time limit that its `monet-noop` warm start may take."""


def warm_schedules(problem: Problem, budget: int, how: str, options: SolveOptions) -> Iterator[list]:
    """The fitting schedules of the named cheaper solver at `budget`, in turn for 'auto' (checkpoint-all,
    monet-noop where `problem` has variants, hierarchical, ap-greedy), each computed only when the one
    before did not seed the MILP."""
    if how == "none":
        return
    if how in ("checkpoint-all", "auto"):
        schedule = default_schedule(problem)
        if simulate(problem, schedule).peak_bytes <= budget:
            yield schedule
        if how == "checkpoint-all":
            return
    if how == "monet-noop" or (how == "auto" and problem.has_variants):
        limit = None if options.time_limit is None else options.time_limit * NOOP_SHARE
        noop = solve_monet(problem.without_variants(), budget, replace(options, time_limit=limit, mip_start=None,
                                                                       params=MonetOptions()), "monet-noop")
        if noop.schedule is not None:
            yield noop.schedule
        if how == "monet-noop":
            return
    for name in ("hierarchical", "ap-greedy") if how == "auto" else (how,):
        sol = options.peers[name](problem, budget, SolveOptions(time_limit=options.time_limit, threads=options.threads,
                                                           backend=options.backend, portfolio=False))
        if sol.schedule is not None:
            yield sol.schedule


def solve_monet(problem: Problem, budget: int, options: SolveOptions, name: str = "monet",
                retained: float | None = None) -> Solution:
    """Build MONeT's program at `budget`, start it from the warm schedule, solve, simulate."""
    start = time.perf_counter()
    lower = min_budget_lower_bound(problem)
    if budget < lower:
        return Solution(name, budget, "infeasible", solve_seconds=time.perf_counter() - start,
                        min_budget_lower_bound=lower,
                        message=f"no schedule fits: some node needs {lower} bytes for its inputs, outputs and workspace")
    try:
        model, L = build_model(problem, budget, retained=retained)
    except ProblemError as exc:
        return Solution(name, budget, "no_solution", solve_seconds=time.perf_counter() - start, message=str(exc))
    opts: MonetOptions = options.params if isinstance(options.params, MonetOptions) else MonetOptions()
    tried, mip_start = [], None    # warm schedules, until one lies in MONeT's space and seeds the MILP
    for schedule in [options.mip_start] if options.mip_start is not None else \
            warm_schedules(problem, budget, opts.warm_start, options):
        tried.append(schedule)
        x_int = integer_assignment(L, schedule)
        if x_int is not None and (mip_start := complete_start(model, L, x_int, options.threads)) is not None:
            break
    if tried and mip_start is None:
        log.info("%s: no warm start is in MONeT's schedule space or model; starting cold", name)
    left = None if options.time_limit is None else max(options.time_limit - (time.perf_counter() - start), 0.0)
    offset = time.perf_counter() - start
    result = solve_milp(model, MilpOptions(backend=options.backend, time_limit=left, gap=options.gap,
                                           threads=options.threads, mip_start=mip_start))
    progress = [Progress(p.seconds + offset, p.incumbent, p.bound) for p in result.progress]
    common = dict(backend=result.backend, num_variables=result.num_variables, num_constraints=result.num_constraints,
                  progress=progress, bound=result.bound, solve_seconds=time.perf_counter() - start)
    if result.status == "infeasible":
        return Solution(name, budget, "infeasible", min_budget_lower_bound=lower,
                        message="the MILP proved that no schedule in MONeT's space fits", **common)
    found = []                     # (cost, schedule, status): the MILP's schedule, and the warm schedules that
    if result.x is not None:       # fit (they may lie outside MONeT's space, where the MILP cannot reach them)
        milp_schedule = schedule_from_solution(L, result.x)
        try:
            found.append((simulate(problem, milp_schedule).compute_cost, milp_schedule,
                          "optimal" if result.status == "optimal" else "feasible"))
        except InvalidSchedule as exc:  # seen once on a ResNet-50 block (a variant's value read, not made)
            log.warning("%s: the MILP's answer (status %s) is not a schedule the simulator accepts, dropped: %s",
                        name, result.status, exc)
    for schedule in tried:
        sim = simulate(problem, schedule)
        if sim.peak_bytes <= budget:
            found.append((sim.compute_cost, schedule, "feasible"))
    if found:
        _, schedule, status = min(found, key=lambda f: f[0])
    else:
        schedule, status = None, "time_limit" if result.status == "time_limit" else "no_solution"
    return checked_solution(problem, name, budget, schedule, status=status, message=result.message, **common)


def monet(problem: Problem, budget: int, options: SolveOptions) -> Solution:
    """Checkpoints and implementations jointly (sec. 4, eq. 9)."""
    return solve_monet(problem, budget, options, "monet")


def monet_noop(problem: Problem, budget: int, options: SolveOptions) -> Solution:
    """Checkpoints only (the registry hands it the problem without variants): MONeT-NoOp."""
    return solve_monet(problem, budget, options, "monet-noop")


def block_rung(problem: Problem, budget: int, limit: float, start: list | None, left: float, gap: float,
               backend: str, threads: int | None) -> list | None:
    """MONeT's schedule of a block under `budget` retaining at most `limit` bytes, started from the schedule
    `start`: the inner solver of `hierarchical` with `inner = "monet"` (passed in by the registry)."""
    options = SolveOptions(time_limit=left, gap=gap, backend=backend, threads=threads, params=MonetOptions("none"),
                           mip_start=start, portfolio=False)
    return solve_monet(problem, budget, options, retained=limit).schedule
