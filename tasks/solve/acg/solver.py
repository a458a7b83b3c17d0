"""The `acg` solver: optimal gradient checkpoints on arbitrary computation graphs (Feng & Huang 2021).

Modes (`AcgOptions.mode`):
- "memory": the paper's problem. Algorithm 6 minimizes eq. (2), sum of the checkpoints' bytes + the
  largest segment, with no budget; the solution is returned when its simulated peak fits the budget.
- "budget" (default): the least recomputation whose simulated peak fits the budget, over ACG's family
  (every checkpoint set, each scheduled by `reforward_schedule`). Exact when the family is small: with
  at most `exact_limit` sets, every set whose recomputation lower bound (each non-checkpoint vertex a
  gradient reads is computed again, at least once) does not exceed the best cost found is simulated, in
  increasing order of that bound, so the cheapest fitting set is returned. Larger families get a
  heuristic, a Lagrangian relaxation of the budget: with checkpoint weights w(v) = l(v) - mu * t(v)
  (t = the vertex's compute cost, what recomputing it costs), Algorithm 6 minimizes
  sum_R w(v) + max segment = (eq. 2 memory) - mu * (compute the checkpoints save), which for a given mu
  is the cheapest checkpoint set on the lower convex hull of (eq. 2 memory, recomputation). mu = 0 is
  the paper's memory optimum, a large mu keeps every vertex. Bisection over the break-even multipliers
  l(v)/t(v) finds the largest mu whose schedule fits; every candidate is measured by the simulator and
  the cheapest that fits is returned. What the heuristic guarantees: the schedule fits the budget, and
  it recomputes no more than the memory-optimal set (eq. 2) whenever that set fits (it is a candidate);
  it is not always the cheapest set of the family (eq. 2 only approximates the simulated peak, and
  the hull skips sets inside it). No schedule is returned only when no candidate fits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from memplan.tasks.solve.acg.division import Segment, division_tree
from memplan.tasks.solve.acg.forward import ForwardGraph, all_vertices, forward_graph, reforward_schedule
from memplan.tasks.solve.acg.search import AcgSolution, DivisionSearch, acg_checkpoints
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import Simulation, default_schedule, simulate
from memplan.tasks.solve.core.solution import Solution, SolveOptions, checked_solution

@dataclass(frozen=True)
class AcgOptions:
    """Options of `acg`."""

    mode: Literal["budget", "memory"] = field(default="budget", metadata={
        "help": "'budget': least recomputation whose simulated peak fits (exact search of small families, else Lagrangian heuristic); "
                "'memory': the paper's memory optimum, eq. (2)."})
    keep: tuple[int, ...] = field(default=(), metadata={
        "help": "node ids that must be checkpoints (never recomputed)."})
    exact_limit: int = field(default=4096, metadata={
        "help": "budget mode: search every checkpoint set exactly when there are at most this many "
                "(2^(vertices that may be recomputed)); otherwise the Lagrangian heuristic."})


@dataclass(frozen=True)
class Candidate:
    """A checkpoint set, its schedule and the simulator's measure of it."""

    checkpoints: int
    schedule: list[tuple[str, int]]
    simulation: Simulation


def evaluate(fg: ForwardGraph, checkpoints: int) -> Candidate:
    schedule = reforward_schedule(fg, checkpoints)
    return Candidate(checkpoints, schedule, simulate(fg.problem, schedule))


def memory_optimal(fg: ForwardGraph, root: Segment) -> AcgSolution:
    """Algorithm 6 on `fg` with w = l: the checkpoints minimizing eq. (2)."""
    return acg_checkpoints(fg.dag, search=DivisionSearch(fg.dag, root))


def budgeted(fg: ForwardGraph, root: Segment, budget: int,
             deadline: float | None = None) -> tuple[Candidate | None, list[Candidate]]:
    """The cheapest candidate within `budget` found by the multiplier bisection (module docstring),
    and every candidate evaluated (memory optimum first). None when even the memory optimum does not fit."""
    tried = [evaluate(fg, memory_optimal(fg, root).checkpoints)]
    if tried[0].simulation.peak_bytes > budget:
        return None, tried
    tried.append(evaluate(fg, all_vertices(fg)))
    if tried[-1].simulation.peak_bytes <= budget:
        return tried[-1], tried
    cost = np.asarray(fg.dag.cost, dtype=float)
    positive = fg.time > 0
    breaks = np.unique(cost[positive] / fg.time[positive])
    lo, hi = -1, len(breaks)          # breaks[lo] fits (lo = -1: mu = 0), breaks[hi] does not
    seen = {tried[0].checkpoints, tried[1].checkpoints}
    while hi - lo > 1 and (deadline is None or time.perf_counter() < deadline):
        mid = (lo + hi) // 2
        mu = float(breaks[mid])
        search = DivisionSearch(fg.dag, root, cost - mu * fg.time)
        checkpoints = acg_checkpoints(fg.dag, search=search).checkpoints
        if checkpoints in seen:
            fits = next(c for c in tried if c.checkpoints == checkpoints).simulation.peak_bytes <= budget
        else:
            seen.add(checkpoints)
            tried.append(evaluate(fg, checkpoints))
            fits = tried[-1].simulation.peak_bytes <= budget
        lo, hi = (mid, hi) if fits else (lo, mid)
    fitting = [c for c in tried if c.simulation.peak_bytes <= budget]
    return min(fitting, key=lambda c: (c.simulation.compute_cost, c.simulation.peak_bytes)), tried


def exhaustive(fg: ForwardGraph, budget: int, best: Candidate | None,
               deadline: float | None = None) -> tuple[Candidate | None, int, bool]:
    """The cheapest checkpoint set of the whole family within `budget` (ties: the least peak), starting
    from the incumbent `best`. A set's compute cost is at least the no-recomputation cost plus t(v) of
    each non-checkpoint vertex whose outputs a backward node reads (its segment's re-forward computes
    it); sets are simulated in increasing order of that bound until it exceeds the best cost found.
    Returns the best candidate, the number of sets simulated and whether the search finished."""
    dag, problem = fg.dag, fg.problem
    fixed = (1 << dag.source) | (1 << dag.target) | dag.forced
    free = np.array([v for v in range(dag.n) if not fixed >> v & 1], dtype=np.int64)
    backward = ~problem.is_recomputable[problem.order]
    read = {int(problem.value_producer[v]) for n in problem.order[backward] for v in problem.node_inputs[n]}
    extra = np.array([fg.time[v] if dag.labels[v] in read else 0.0 for v in free])
    chosen = (np.arange(1 << len(free))[:, None] >> np.arange(len(free))) & 1      # row i: set i's free bits
    bound = float(problem.cost.sum()) + (1 - chosen) @ extra
    simulated = 0
    for i in np.argsort(bound, kind="stable"):
        if best is not None and bound[i] > best.simulation.compute_cost:
            return best, simulated, True
        if deadline is not None and time.perf_counter() >= deadline:
            return best, simulated, False
        found = evaluate(fg, fixed | sum(1 << int(v) for v in free[chosen[i] == 1]))
        simulated += 1
        sim = found.simulation
        if sim.peak_bytes <= budget and (best is None or (sim.compute_cost, sim.peak_bytes)
                                         < (best.simulation.compute_cost, best.simulation.peak_bytes)):
            best = found
    return best, simulated, True


def acg(problem: Problem, budget: int, options: SolveOptions) -> Solution:
    """Solver `acg` (module docstring); the schedule is `reforward_schedule` of the checkpoints."""
    start = time.perf_counter()
    deadline = None if options.time_limit is None else start + options.time_limit
    opts: AcgOptions = options.params
    mode = opts.mode
    if problem.is_recomputable.all():
        return checked_solution(problem, "acg", budget, default_schedule(problem), solve_seconds=time.perf_counter() - start,
                                message="the graph has no backward pass, so no gradient checkpoint lowers its peak")
    fg = forward_graph(problem, keep=opts.keep)
    try:
        root = division_tree(fg.dag, deadline)
    except TimeoutError as exc:
        return checked_solution(problem, "acg", budget, None, solve_seconds=time.perf_counter() - start,
                                message=f"{exc} ({fg.dag.n} vertices); raise the time limit")
    if mode == "memory":
        found = memory_optimal(fg, root)
        best = evaluate(fg, found.checkpoints)
        message = (f"{found.checkpoints.bit_count()} checkpoints, eq. (2) memory {found.memory} B "
                   f"(largest segment {found.max_segment} B)")
    else:
        best, tried = budgeted(fg, root, budget, deadline)
        message = (f"Lagrangian search: {len(tried)} checkpoint sets simulated; the memory-optimal set (eq. 2) "
                   f"peaks at {tried[0].simulation.peak_bytes} B")
        family = 1 << (fg.dag.n - (fg.dag.forced | 1 | 1 << fg.dag.target).bit_count())
        if family <= opts.exact_limit:
            best, simulated, finished = exhaustive(fg, budget, best, deadline)
            message += (f"; exact search over the {family} checkpoint sets: {simulated} simulated"
                        + ("" if finished else ", stopped by the time limit"))
        if best is not None:
            message += f"; chose {best.checkpoints.bit_count()} checkpoints"
    return checked_solution(problem, "acg", budget, None if best is None else best.schedule,
                            solve_seconds=time.perf_counter() - start, message=message)
