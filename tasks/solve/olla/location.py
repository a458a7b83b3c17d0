"""OLLA's tensor-location ILP (Steiner et al. 2022, sec. 3.3 and 4.4-4.5, eq. 15) for any schedule.

Given a schedule (OLLA's order or any solver's, recomputations included), every placeable copy
(`tasks.solve.core.addresses.placeable`: the rules greedy placement follows) gets an arena offset so that
copies live at a common step never overlap and the arena is as small as possible. Sizes and offsets
are in units of `ALIGNMENT` bytes. The lifetimes are fixed by the schedule, so the pairs to separate
are exactly the placed copies whose live steps intersect (what the precedence and MUL pruning of
sec. 4.2 approximate before the order is known). Per such pair (i, j), one binary a[i,j]:

| block                         | rows                                               | paper      |
|-------------------------------|----------------------------------------------------|------------|
| live together: one side holds | a[i,j] + b[i,j] >= 1, with b[i,j] = 1 - a[i,j]     | eq. 6      |
| i below j when a = 1          | A_i + S_i - A_j <= (1 - a[i,j]) M                  | eq. 7a     |
| i above j when a = 0          | A_i - A_j - S_j >= (b[i,j] - 1) M = -a[i,j] M      | eq. 7b     |
| arena                         | A_i + S_i <= peak_mem                              | eq. 8      |

minimizing `peak_mem` (eq. 15). M is the best arena known (greedy's), so the ILP only looks for better
ones; `peak_mem` is at least the most bytes live at once (a lower bound: live copies are disjoint).
The pyramid of Function 5 (copies nested in each other's lifetimes, longest first, stacked from
address 0) is pre-placed and fixed. The greedy placement (largest first, best gap) and the pyramid
completed by best gap are the MIP start; the best of these and the ILP's incumbent is returned, so the
arena is never larger than greedy's, and on a time-out the best placement found so far is kept.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from memplan.tasks.solve.core.addresses import ALIGNMENT, best_gap, greedy_addresses, placeable
from memplan.tasks.solve.core.milp import MilpModel, MilpOptions, solve_milp
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import Simulation


@dataclass
class LocationResult:
    """Addresses {(step computing the copy, value): offset}, their arena bytes (extent, as the simulator
    counts it), the most bytes the placed copies hold live at once (a lower bound), which placement won ("greedy", "pyramid", "ilp"),
    the MILP status (None when it was not needed) and the time spent."""

    addresses: dict[tuple[int, int], int]
    arena_bytes: int
    live_bytes: int
    source: str
    status: str | None
    seconds: float
    num_variables: int = 0
    num_constraints: int = 0


def pyramid(start: np.ndarray, end: np.ndarray, size: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Function 5 on copies with lifetimes [start, end]: repeatedly take the longest-lived unplaced copy
    nested in the previous one's lifetime and stack it on top. Returns (indices, offsets)."""
    chosen, offsets = [], []
    lo, hi, base = -1, np.iinfo(np.int64).max, 0
    free = np.ones(len(start), dtype=bool)
    duration = end - start
    while True:
        ok = free & (start >= lo) & (end <= hi) & (duration > 0)
        if not ok.any():
            break
        k = int(np.flatnonzero(ok)[np.lexsort((-size[ok], -duration[ok]))[0]])
        chosen.append(k)
        offsets.append(base)
        base += int(size[k])
        lo, hi, free[k] = int(start[k]), int(end[k]), False
    return np.array(chosen, dtype=np.int64), np.array(offsets, dtype=np.int64)


def best_fit(start: np.ndarray, end: np.ndarray, size: np.ndarray, fixed: np.ndarray,
             fixed_at: np.ndarray) -> np.ndarray:
    """Offsets of all copies: `fixed` ones at `fixed_at`, the rest largest first at the lowest-waste gap
    among the placed copies they overlap in time (the greedy rule)."""
    lo = np.full(len(start), -1, dtype=np.int64)
    lo[fixed] = fixed_at
    for k in np.lexsort((start, -(end - start), -size)):
        if lo[k] >= 0:
            continue
        overlap = (lo >= 0) & (start <= end[k]) & (end >= start[k])
        lo[k] = best_gap(lo[overlap], lo[overlap] + size[overlap], int(size[k]))
    return lo


def live_pairs(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pairs (i < j) of copies whose live steps intersect."""
    order = np.argsort(start, kind="stable")
    i_list, j_list = [], []
    for a in range(len(order)):
        i = order[a]
        later = order[a + 1:]
        hit = later[start[later] <= end[i]]
        i_list.append(np.full(len(hit), i))
        j_list.append(hit)
    if not i_list:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    i, j = np.concatenate(i_list), np.concatenate(j_list)
    return np.minimum(i, j).astype(np.int64), np.maximum(i, j).astype(np.int64)


def olla_addresses(problem: Problem, sim: Simulation, steps: np.ndarray | None = None, *,
                   time_limit: float | None = None, gap: float = 0.0, backend: str = "auto",
                   threads: int | None = None, use_pyramid: bool = True) -> LocationResult:
    """Addresses for the placeable copies of the simulated schedule (module docstring); `steps` masks
    the schedule steps the runtime writes in place (as for `greedy_addresses`)."""
    begin = time.perf_counter()
    ids = np.flatnonzero(placeable(problem, sim, steps))
    size = -(-sim.copy_bytes[ids] // ALIGNMENT)
    start, end = sim.copy_start[ids], sim.copy_end[ids]
    live = _live_units(start, end, size, len(sim.timeline))

    greedy = greedy_addresses(problem, sim, steps)
    g_off = np.array([greedy[int(sim.copy_start[c]), int(sim.copy_value[c])] for c in ids], dtype=np.int64) // ALIGNMENT
    candidates = [("greedy", g_off)]
    fixed, fixed_at = pyramid(start, end, size) if use_pyramid else (np.zeros(0, np.int64), np.zeros(0, np.int64))
    candidates.append(("pyramid", best_fit(start, end, size, fixed, fixed_at)))
    source, offsets = min(candidates, key=lambda c: _extent(c[1], size))
    status, nvars, ncons = None, 0, 0
    if _extent(offsets, size) > live:
        bound = max(_extent(offsets, size), _extent(candidates[1][1], size))    # the MIP start must fit
        model, free_cols, pairs = _location_model(start, end, size, fixed, fixed_at, bound, live)
        start_x = _assignment(model, free_cols, pairs, size, candidates[1][1])
        result = solve_milp(model, MilpOptions(backend=backend, time_limit=time_limit, gap=gap, threads=threads,
                                               mip_start=start_x))
        status, nvars, ncons = result.status, model.num_variables, model.num_constraints
        if result.x is not None:
            ilp = candidates[1][1].copy()
            ilp[free_cols >= 0] = np.round(result.x[free_cols[free_cols >= 0]]).astype(np.int64)
            if _extent(ilp, size) < _extent(offsets, size) and _disjoint(start, end, size, ilp):
                source, offsets = "ilp", ilp
    addresses = {(int(sim.copy_start[c]), int(sim.copy_value[c])): int(o) * ALIGNMENT for c, o in zip(ids, offsets)}
    arena = int((offsets * ALIGNMENT + sim.copy_bytes[ids]).max(initial=0))
    mask = np.zeros(len(sim.copy_value), dtype=bool)
    mask[ids] = True
    return LocationResult(addresses, arena, int(sim.live_timeline(mask).max(initial=0)), source, status,
                          time.perf_counter() - begin, nvars, ncons)


def _location_model(start, end, size, fixed, fixed_at, M: int, live: int) -> tuple[MilpModel, np.ndarray, tuple]:
    """Eq. 6-8 and 15 over the copies not in `fixed` (module docstring). Columns: A of each free copy,
    a[i,j] of each live pair (i, j) with a free member, peak_mem. Returns the model, `free_cols[k]`
    (copy k's A column, or -1) and the pairs."""
    n = len(start)
    is_fixed = np.zeros(n, dtype=bool)
    is_fixed[fixed] = True
    fixed_off = np.zeros(n, dtype=np.int64)
    fixed_off[fixed] = fixed_at
    free = np.flatnonzero(~is_fixed)
    free_cols = np.full(n, -1, dtype=np.int64)
    free_cols[free] = np.arange(len(free))
    i, j = live_pairs(start, end)
    keep = ~(is_fixed[i] & is_fixed[j]) & (size[i] > 0) & (size[j] > 0)
    i, j = i[keep], j[keep]
    npairs = len(i)
    a_col = len(free) + np.arange(npairs)
    peak = len(free) + npairs
    k = np.arange(npairs)
    # rows 2k (7a): A_i - A_j + M a <= M - S_i ; rows 2k+1 (7b): A_i - A_j + M a >= S_j
    rows, cols, vals = [], [], []
    for sign, who in ((1.0, i), (-1.0, j)):
        var = ~is_fixed[who]
        for r in (2 * k, 2 * k + 1):
            rows.append(r[var])
            cols.append(free_cols[who[var]])
            vals.append(np.full(int(var.sum()), sign))
    const = np.where(is_fixed[i], fixed_off[i], 0) - np.where(is_fixed[j], fixed_off[j], 0)
    rows += [2 * k, 2 * k + 1]
    cols += [a_col, a_col]
    vals += [np.full(npairs, float(M)), np.full(npairs, float(M))]
    lower = np.empty(2 * npairs)
    upper = np.empty(2 * npairs)
    lower[0::2], upper[0::2] = -np.inf, M - size[i] - const
    lower[1::2], upper[1::2] = size[j] - const, np.inf
    # eq. 8: A_k + S_k - peak <= 0 for each free copy
    r8 = 2 * npairs + np.arange(len(free))
    rows += [r8, r8]
    cols += [np.arange(len(free)), np.full(len(free), peak)]
    vals += [np.ones(len(free)), -np.ones(len(free))]
    lower = np.concatenate([lower, np.full(len(free), -np.inf)])
    upper = np.concatenate([upper, -size[free].astype(float)])
    A = sp.csr_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
                      shape=(len(lower), peak + 1))
    top = int((fixed_at + size[fixed]).max(initial=0))
    col_lower = np.zeros(peak + 1)
    col_lower[peak] = max(live, top)
    col_upper = np.concatenate([(M - size[free]).astype(float), np.ones(npairs), [float(M)]])
    c = np.zeros(peak + 1)
    c[peak] = 1.0
    integrality = np.concatenate([np.ones(len(free) + npairs, dtype=bool), [False]])
    model = MilpModel(c, A, lower, upper, col_lower, col_upper, integrality, objective_scale=float(ALIGNMENT))
    return model, free_cols, (i, j)


def _assignment(model: MilpModel, free_cols: np.ndarray, pairs: tuple, size: np.ndarray,
                offsets: np.ndarray) -> np.ndarray:
    """The model's variables for a placement `offsets` that keeps the fixed copies where they are."""
    i, j = pairs
    free = free_cols >= 0
    x = np.zeros(model.num_variables)
    x[free_cols[free]] = offsets[free]
    x[int(free.sum()) + np.arange(len(i))] = offsets[i] + size[i] <= offsets[j]
    x[-1] = _extent(offsets, size)
    return x


def _extent(offsets: np.ndarray, size: np.ndarray) -> int:
    return int((offsets + size).max(initial=0))


def _live_units(start, end, size, steps: int) -> int:
    delta = np.zeros(steps + 1, dtype=np.int64)
    np.add.at(delta, start, size)
    np.add.at(delta, end + 1, -size)
    return int(np.cumsum(delta).max(initial=0))


def _disjoint(start, end, size, offsets) -> bool:
    i, j = live_pairs(start, end)
    return bool(np.all((offsets[i] + size[i] <= offsets[j]) | (offsets[j] + size[j] <= offsets[i])
                       | (size[i] == 0) | (size[j] == 0)))
