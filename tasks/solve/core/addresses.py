"""Addresses for the value copies of a schedule: where each copy lives in one arena per step.

`greedy_addresses` is the classic offline placement used as OLLA's fallback and MIP start (Steiner et
al. 2022, sec. 4.4): copies in decreasing size (longer lifetime first on ties), each at the lowest-waste
gap ("best fit") among the copies already placed whose lifetimes overlap its own, or on top of them.
Every copy a step allocates is placed except the final copy of a graph output, which outlives the step
(the simulator's `check_addresses` refuses such an address), the copies an in-place step overwrites or
writes (they share storage beyond one copy's lifetime; refused likewise), empty copies, and the copies of steps the
runtime cannot write in place (`steps`, from `runtime.execute.arena.in_place_nodes`): a slot for those would
stay an unused hole in the arena.
"""

from __future__ import annotations

import numpy as np

from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import Simulation

ALIGNMENT = 64
"""Bytes every offset is a multiple of (the widest dtype, and a cache line)."""


def placeable(problem: Problem, sim: Simulation, steps: np.ndarray | None = None) -> np.ndarray:
    """Copies that may get an address: non-empty, not the final copy of a graph output, not a copy of an
    in-place step (`Simulation.in_place`), and computed at a step that `steps` (a boolean mask over
    schedule steps; None: all) allows."""
    allowed = np.ones(len(sim.copy_value), dtype=bool) if steps is None else np.asarray(steps)[sim.copy_start]
    return (sim.copy_bytes > 0) & ~sim.outlives_step(problem) & ~sim.in_place & allowed


def greedy_addresses(problem: Problem, sim: Simulation, steps: np.ndarray | None = None,
                     alignment: int = ALIGNMENT) -> dict[tuple[int, int], int]:
    """Largest-first, best-gap placement of every placeable copy of the simulated schedule (module
    docstring); returns {(step computing the copy, value): offset}."""
    ids = np.flatnonzero(placeable(problem, sim, steps))
    size = -(-sim.copy_bytes[ids] // alignment) * alignment
    start, end = sim.copy_start[ids], sim.copy_end[ids]
    order = np.lexsort((start, -(end - start), -size))
    lo = np.full(len(ids), -1, dtype=np.int64)              # offset of each placed copy, -1 while unplaced
    for k in order:
        overlap = (lo >= 0) & (start <= end[k]) & (end >= start[k])
        lo[k] = best_gap(lo[overlap], lo[overlap] + size[overlap], int(size[k]))
    return {(int(sim.copy_start[c]), int(sim.copy_value[c])): int(o) for c, o in zip(ids, lo)}


def best_gap(lows: np.ndarray, highs: np.ndarray, size: int) -> int:
    """The lowest offset of the smallest free gap of at least `size` bytes between the busy ranges
    [lows, highs), or the top of the highest range when none fits."""
    if not len(lows):
        return 0
    order = np.argsort(lows, kind="stable")
    lows, highs = lows[order], np.maximum.accumulate(highs[order])
    gap_start = np.concatenate(([0], highs[:-1]))
    gap = lows - gap_start
    fits = np.flatnonzero(gap >= size)
    if not len(fits):
        return int(highs[-1])
    best = fits[np.argmin(gap[fits])]
    return int(gap_start[best])
