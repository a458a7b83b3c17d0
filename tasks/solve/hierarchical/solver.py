"""`hierarchical`: Rockmate's plan (Zhao et al. 2023) on the project's simulator.

1. Cut the step into a chain of blocks (blocks.py); identical blocks are one problem.
2. Solve each distinct block for a ladder of retention and peak limits with the exact inner solver
   (ladder.py; `inner = "checkmate"`: Checkmate's MILP, on the step with its time-saving variant families
   fixed, as `dtr` fixes them; `inner = "monet"`: MONeT's program, which also picks the block's
   implementation variants; each solve bounded by `inner_time_limit`).
3. Pick one option per block by the chain dynamic program (chain.py) and compose the schedule: every
   block's forward part in order, then every backward part in reverse; and by Rotor's nested program
   (`nested_chain_dp`), where a block boundary need not be kept: a later part of the chain runs forward
   keeping only its output and is run forward again from an earlier kept boundary. The programs' memory
   model is an estimate; the simulator judges each composed schedule, and the programs are re-run for a
   few working budgets around the target to return the cheapest schedule that fits.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Annotated, Literal

import numpy as np
from pydantic import Field

from memplan.tasks.solve.core.fixed_variants import Choice as VariantChoice, candidate_choices, fixed_problem, tag_schedule
from memplan.tasks.solve.hierarchical.blocks import BlockChain, block_chain, blocks_by_key
from memplan.tasks.solve.hierarchical.chain import Choice, Op, Sweep, chain_dp, nested_chain_dp
from memplan.tasks.solve.hierarchical.ladder import RUNGS, BlockOption, ladder, option, recompute_block
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import default_schedule, simulate
from memplan.tasks.solve.core.solution import Solution, SolveOptions, checked_solution

WORKING_BUDGETS = np.geomspace(0.8, 1.25, 13)
"""Budgets the chain program is run at, as fractions of the target (1.0 among them: the program's
estimate bounds the simulated peak, so a composition that fits by the estimate is always found)."""

Fraction = Annotated[float, Field(ge=0.0, le=1.0)]

_LADDERS: dict[tuple, list[BlockOption]] = {}
"""Block ladders by (block key, node costs, settings): a pipeline or benchmark solving one graph at
several budgets solves each block once."""


@dataclass(frozen=True)
class HierarchicalOptions:
    """Options of `hierarchical`."""

    inner: Literal["checkmate", "monet"] = field(default="checkmate", metadata={
        "help": "exact solver of each block's ladder: 'checkmate' (MILP with a retention limit) or 'monet' "
                "(MONeT's program with a retention limit, choosing implementation variants too)."})
    block_size: Annotated[int, Field(ge=1)] = field(default=24, metadata={
        "help": "forward nodes per block: segments between articulation points are merged up to this size."})
    inner_time_limit: Annotated[float, Field(gt=0.0)] = field(default=5.0, metadata={
        "help": "seconds per block MILP (its best schedule so far is used when it stops)."})
    rungs: tuple[tuple[Fraction, Fraction], ...] = field(default=RUNGS, metadata={
        "help": "ladder rungs (retained fraction, peak fraction) solved for every distinct block."})
    greedy: bool = field(default=True, metadata={
        "help": "add the retention-greedy options (recompute the cheapest bytes first) to every ladder."})


def _block_ladder(problem: Problem, num_forward: int, key: str, opts: HierarchicalOptions,
                  options: SolveOptions, deadline: float | None) -> list[BlockOption]:
    """The block's ladder, from the cache when a complete one was solved before."""
    digest = hashlib.sha256(problem.cost.tobytes()).hexdigest()
    cache_key = (key, digest, opts.inner, opts.rungs, opts.inner_time_limit, opts.greedy, options.gap, options.backend)
    if cache_key in _LADDERS:
        return _LADDERS[cache_key]
    inner = options.peers["monet-block"] if opts.inner == "monet" else None
    found, complete = ladder(problem, num_forward, opts.rungs, time_limit=opts.inner_time_limit, deadline=deadline,
                             gap=options.gap, backend=options.backend, threads=options.threads, inner=inner,
                             greedy=opts.greedy)
    if complete:
        _LADDERS[cache_key] = found
    return found


def compose(chain: BlockChain, picked: list[BlockOption]) -> list[tuple[str, int]]:
    """Forward parts in block order, then backward parts in reverse block order, as global nodes."""
    return compose_ops(chain, [*(("forward", i, 0) for i in range(len(picked))),
                               *(("backward", i, 0) for i in reversed(range(len(picked))))],
                       [[o] for o in picked])


def compose_ops(chain: BlockChain, ops: list[Op], per_block: list[list[BlockOption]]) -> list[tuple]:
    """The schedule of a nested program's operations (`chain.Op`), as global compute steps carrying each
    step's implementation variant where it is not the default."""
    steps: list[tuple] = []
    for kind, i, o in ops:
        block = chain.blocks[i]
        if kind == "sweep":
            local = [("compute", n) for n in range(block.num_forward)]
        else:
            picked = per_block[i][o]
            local = picked.steps(0, picked.split) if kind == "forward" else \
                picked.steps(picked.split, len(picked.schedule))
        steps += [("compute", int(block.nodes[s[1]]), *s[2:]) for s in local]
    return steps


def sweep(block, sub: Problem) -> Sweep:
    """Rotor's F_ck of a block: its forward nodes in order, keeping only its outputs."""
    bare = option(sub, block.num_forward, recompute_block(sub, block.num_forward))
    return Sweep(float(sub.cost[:block.num_forward].sum()), bare.forward_peak, bare.retained)


def hierarchical(problem: Problem, budget: int, options: SolveOptions) -> Solution:
    """Block chain, per-block ladders, chain dynamic program (module docstring)."""
    start = time.perf_counter()
    deadline = None if options.time_limit is None else start + options.time_limit
    original = problem
    opts: HierarchicalOptions = options.params
    problem, choice = (problem, {}) if opts.inner == "monet" else _time_saving_fixed(problem)
    floor = _cost_floor(original)
    if not problem.is_recomputable.any():
        return checked_solution(original, "hierarchical", budget, tag_schedule(default_schedule(problem), choice),
                                bound=floor, solve_seconds=time.perf_counter() - start,
                                message="no forward nodes to recompute")
    chain = block_chain(problem, opts.block_size)
    distinct = blocks_by_key(chain)
    ladders = {key: _block_ladder(sub, block.num_forward, key, opts, options, deadline)
               for key, (block, sub) in distinct.items()}
    per_block = [ladders[b.key] for b in chain.blocks]
    choices = [[Choice(o.cost(b.problem.cost), o.forward_peak, o.backward_peak, o.retained) for o in opts_]
               for b, opts_ in zip(chain.blocks, per_block)]
    external = chain.external
    sweeps = [sweep(b, b.problem) for b in chain.blocks]
    best = None
    for factor in WORKING_BUDGETS:
        picked = chain_dp(choices, external, factor * budget)
        ops = nested_chain_dp(choices, sweeps, external, factor * budget)
        candidates = [] if picked is None else [(compose(chain, [per_block[i][o] for i, o in enumerate(picked)]), "")]
        if ops is not None and any(kind == "sweep" for kind, _, _ in ops):
            candidates.append((compose_ops(chain, ops, per_block), " (nested)"))
        for schedule, how in candidates:
            sim = simulate(problem, schedule)
            if sim.peak_bytes <= budget and (best is None or sim.compute_cost < best[1].compute_cost):
                best = (schedule, sim, factor, how)
    message = (f"{len(chain.blocks)} blocks ({len(distinct)} distinct), "
               f"{sum(map(len, ladders.values()))} block options")
    if best is None:
        return Solution("hierarchical", budget, "no_solution", solve_seconds=time.perf_counter() - start,
                        bound=floor, message=message + "; no composition fits the budget")
    return checked_solution(original, "hierarchical", budget, tag_schedule(best[0], choice),
                            bound=floor, solve_seconds=time.perf_counter() - start,
                            message=message + f"; chain program{best[3]} at {best[2]:.2f}x the budget")


def _cost_floor(problem: Problem) -> float:
    """Every node once in its cheapest implementation: no schedule of `problem` costs less."""
    return float(sum(min(problem.variant(n, impl).cost for impl in problem.impls(n)) for n in range(problem.num_nodes)))


def _time_saving_fixed(problem: Problem) -> tuple[Problem, VariantChoice]:
    """For a recompute-only inner solver: the problem without variants, but with the time-saving families
    fixed (tasks/solve/core/fixed_variants.py: variants reading and allocating what their defaults do, at least
    5% cheaper as profiled, such as the GELU's tanh by its sigmoid identity), and that choice."""
    if not problem.has_variants:
        return problem, {}
    choice = candidate_choices(problem)[0]
    return fixed_problem(problem, choice), choice
