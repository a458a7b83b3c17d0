"""Greedy rematerialization (`remat-greedy`): a fast, memory- and cost-aware heuristic.

Start from checkpoint-all (every forward node kept) and repeatedly un-keep the forward node whose
recomputation removes the most excess memory, sum over compute steps of max(0, live - budget), per unit
of added compute; every candidate is scored exactly by the recomputation fill (`schedule_from_checkpoints`)
and the simulator. Candidates are the kept nodes with an output live at the peak step. Once within the
budget, un-kept nodes are kept again, most expensive first, while the schedule still fits. It is the
warm start of `checkmate` when `dtr` finds none (its cost against sum of costs, a lower bound, often
proves the gap alone).
"""

from __future__ import annotations

import time

import numpy as np

from memplan.tasks.solve.core.checkpoints import schedule_from_checkpoints
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import Simulation, simulate
from memplan.tasks.solve.core.solution import Solution, SolveOptions, checked_solution


def _excess(sim: Simulation, budget: int) -> float:
    return float(np.maximum(sim.timeline - budget, 0).sum())


def greedy_schedule(problem: Problem, budget: int, deadline: float | None = None) -> list[tuple[str, int]] | None:
    """The greedy schedule within `budget`, or None when no un-keeping step reduces the excess."""
    def evaluate(kept: set[int]) -> tuple[list, Simulation]:
        schedule = schedule_from_checkpoints(problem, [v for n in kept for v in problem.node_outputs[n]])
        return schedule, simulate(problem, schedule)

    kept = {int(v) for v in problem.order if problem.is_recomputable[v]}
    schedule, sim = evaluate(kept)
    removed: list[int] = []
    while sim.peak_bytes > budget:
        if deadline is not None and time.perf_counter() > deadline:
            return None
        excess = _excess(sim, budget)
        live = {int(problem.value_producer[v]) for v in sim.live_values(sim.peak_step)}
        best = None
        for node in sorted(live & kept):
            cand_schedule, cand = evaluate(kept - {node})
            gain = excess - _excess(cand, budget)
            if gain <= 0:
                continue
            score = gain / max(cand.compute_cost - sim.compute_cost, 1e-12 * max(float(problem.cost.sum()), 1.0))
            if best is None or score > best[0]:
                best = (score, node, cand_schedule, cand)
        if best is None:
            return None
        kept.discard(best[1])
        removed.append(best[1])
        schedule, sim = best[2], best[3]
    for node in sorted(removed, key=lambda n: -problem.cost[n]):
        cand_schedule, cand = evaluate(kept | {node})
        if cand.peak_bytes <= budget and cand.compute_cost < sim.compute_cost:
            kept.add(node)
            schedule, sim = cand_schedule, cand
    return schedule


def remat_greedy(problem: Problem, budget: int, options: SolveOptions) -> Solution:
    start = time.perf_counter()
    deadline = None if options.time_limit is None else start + options.time_limit
    schedule = greedy_schedule(problem, budget, deadline)
    return checked_solution(problem, "remat-greedy", budget, schedule, solve_seconds=time.perf_counter() - start,
                            message="" if schedule else "no un-keeping step reduces the memory above the budget")
