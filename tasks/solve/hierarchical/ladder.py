"""A block's options: schedules of the block alone for a ladder of budgets (Rockmate sec. 3.2).

A block's schedule runs in two parts: its forward part while the chain goes forward, and its backward
part (with its recomputations) when the gradient reaches it. What the block costs the rest of the chain
is the bytes it retains between the two (`BlockOption.retained`), so the ladder bounds that with
Checkmate's MILP plus a retention limit (`remat_milp.build_model(retained=...)`): each rung is
(fraction of the freely retained bytes, fraction of the block's own peak). Every rung is started from
the cheapest option found so far that fits it (at first: no recomputation, the schedule that retains
nothing: forward, then forward again and backward, and the options of `retention_greedy`, which
recompute the cheapest bytes first), so the rungs are ordered loose to tight and a MILP stopped by its
time limit still leaves its start.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from memplan.tasks.solve.core.remat_milp import assignment_from_schedule, build_model, schedule_from_solution
from memplan.tasks.solve.core.checkpoints import schedule_from_checkpoints
from memplan.tasks.solve.core.milp import MilpOptions, solve_milp
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import Simulation, default_schedule, simulate
from memplan.tasks.solve.core.solution import min_budget_lower_bound

BlockSolver = Callable[[Problem, int, float, "list | None", float, float, str, "int | None"], "list | None"]
"""An inner solver other than Checkmate's MILP: (block problem, budget, retention limit, start schedule, time
left, gap, backend, threads) -> schedule or None (e.g. `tasks.solve.monet.block_rung`, passed in by the registry)."""

RUNGS = ((1.0, 1.0), (0.6, 1.0), (0.35, 1.0), (0.15, 1.0), (0.0, 1.0), (1.0, 0.8), (0.35, 0.8), (0.0, 0.8),
         (1.0, 0.6), (0.0, 0.6))


@dataclass(frozen=True)
class BlockOption:
    """A schedule of one block (local node ids) with its first `split` steps run going forward.
    Memory is the block's own (its inputs are not counted): peaks of each part and the bytes
    retained across the split."""

    schedule: tuple[int, ...]
    split: int
    forward_peak: int
    backward_peak: int
    retained: int
    impls: tuple[str | None, ...] = ()
    impl_cost: float = 0.0

    def cost(self, node_cost: np.ndarray) -> float:
        """Default costs of the scheduled nodes plus what the chosen implementation variants add."""
        return float(node_cost[list(self.schedule)].sum()) + self.impl_cost

    def steps(self, lo: int, hi: int) -> list[tuple]:
        """Schedule steps lo..hi-1 (local nodes), with their implementation where it is not the default."""
        return [("compute", n, *((self.impls[j],) if self.impls and self.impls[j] else ()))
                for j, n in enumerate(self.schedule[lo:hi], lo)]


def option(problem: Problem, num_forward: int, schedule: list) -> BlockOption:
    """The option of a frontier-advancing block schedule: the forward part ends with the first
    computation of the last forward node."""
    nodes = tuple(int(step[1]) for step in schedule)
    impls = tuple(step[2] if len(step) > 2 and step[2] != "default" else None for step in schedule)
    impls = impls if any(impls) else ()
    split = nodes.index(num_forward - 1) + 1 if num_forward else 0
    sim = simulate(problem, [("compute", n, *((impls[j],) if impls and impls[j] else ())) for j, n in enumerate(nodes)])
    return BlockOption(nodes, split, _max(sim, 0, split), _max(sim, split, len(nodes)),
                       _retained(problem, sim, split), impls, sim.compute_cost - float(problem.cost[list(nodes)].sum()))


def _max(sim: Simulation, lo: int, hi: int) -> int:
    return int(sim.timeline[lo:hi].max(initial=0))


def _retained(problem: Problem, sim: Simulation, split: int) -> int:
    """Bytes held across the split: copies made before it and read after it, and the forward part's
    outputs (other blocks read them before this block's backward part runs, even where the backward
    part computes them again)."""
    before = sim.copy_start < split
    held = before & (sim.copy_end >= split)
    outputs = before & problem.is_output[sim.copy_value]
    return int(problem.value_bytes[np.unique(sim.copy_value[held | outputs])].sum())


def recompute_block(problem: Problem, num_forward: int) -> list[tuple[str, int]]:
    """Forward, then the whole block again: retains only what other blocks need."""
    return [("compute", n) for n in range(num_forward)] + default_schedule(problem)


def retention_greedy(problem: Problem, num_forward: int) -> list[BlockOption]:
    """Options from keeping every forward node down to keeping none, greedily: each step stops keeping
    the forward node whose recomputation frees the most retained bytes per unit of added cost (cheap
    elementwise ops with large outputs go first, dear matmuls last; when none frees bytes alone, the
    cheapest to recompute), each schedule the optimal recomputation fill of what is kept
    (`schedule_from_checkpoints`). Every step that retains fewer bytes is an option."""
    def evaluate(kept: set[int]) -> BlockOption:
        schedule = schedule_from_checkpoints(problem, [v for n in kept for v in problem.node_outputs[n]])
        return option(problem, num_forward, schedule)

    kept = set(range(num_forward))
    current = evaluate(kept)
    out = [current]
    while kept:
        best = None
        for node in sorted(kept):
            cand = evaluate(kept - {node})
            freed = current.retained - cand.retained
            added = max(cand.cost(problem.cost) - current.cost(problem.cost), 1e-9 * float(problem.cost.sum()))
            score = (freed > 0, freed / added if freed > 0 else -added)   # no node frees bytes alone: cheapest
            if freed >= 0 and (best is None or score > best[0]):
                best = (score, node, cand)
        if best is None:
            break
        kept.discard(best[1])
        if best[2].retained < current.retained:
            out.append(best[2])
        current = best[2]
    return out


def ladder(problem: Problem, num_forward: int, rungs=RUNGS, *, time_limit: float, deadline: float | None = None,
           gap: float, backend: str = "auto", threads: int | None = None,
           inner: BlockSolver | None = None, greedy: bool = True) -> tuple[list[BlockOption], bool]:
    """The block's options for `rungs` (module docstring), without duplicate schedules, the
    no-recomputation and retain-nothing schedules included; each MILP (`inner`: None for Checkmate's, or a
    `BlockSolver`, e.g. MONeT's program with the block's implementation variants) gets `time_limit`
    seconds and none starts after `deadline` (perf_counter); with `greedy`, `retention_greedy`'s options
    too. Also says whether every rung was solved."""
    full = option(problem, num_forward, default_schedule(problem))
    bare = option(problem, num_forward, recompute_block(problem, num_forward))
    found = {(full.schedule, full.impls): full, (bare.schedule, bare.impls): bare}
    if num_forward == problem.num_nodes:                     # no backward part: nothing to choose
        return [full], True
    for o in retention_greedy(problem, num_forward) if greedy else ():
        found.setdefault((o.schedule, o.impls), o)
    natural = max(full.forward_peak, full.backward_peak)
    lower = min_budget_lower_bound(problem)
    complete = True
    for keep, peak in rungs:
        left = time_limit if deadline is None else min(time_limit, deadline - time.perf_counter())
        if left <= 0:
            complete = False
            break
        budget = max(int(peak * natural), lower)
        limit = bare.retained + keep * max(full.retained - bare.retained, 0)
        fits = [o for o in found.values() if max(o.forward_peak, o.backward_peak) <= budget and o.retained <= limit]
        cheapest = min(fits, key=lambda o: o.cost(problem.cost)) if fits else None
        if inner is not None:
            schedule = inner(problem, budget, limit, None if cheapest is None else cheapest.steps(0, len(cheapest.schedule)),
                             left, gap, backend, threads)
        else:
            model, L = build_model(problem, budget, retained=(num_forward, limit))
            start = None if cheapest is None else assignment_from_schedule(problem, L, cheapest.steps(0, len(cheapest.schedule)))
            result = solve_milp(model, MilpOptions(backend=backend, time_limit=left, gap=gap, threads=threads,
                                                   mip_start=start))
            schedule = None if result.x is None else schedule_from_solution(L, result.x)
        if schedule is not None:
            found_option = option(problem, num_forward, schedule)
            found.setdefault((found_option.schedule, found_option.impls), found_option)
    return list(found.values()), complete
