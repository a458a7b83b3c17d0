"""MONeT's columns and schedules (tasks/solve/monet/model.py): a solution decoded into the schedule of
Algorithms 1-2, and a schedule in MONeT's space encoded as the model's columns (a warm start)."""

from __future__ import annotations

import numpy as np

from memplan.tasks.solve.core.milp import MilpModel
from memplan.tasks.solve.core.simulator import normalize_schedule, simulate
from memplan.tasks.solve.monet.layout import MonetLayout


def _chosen(L: MonetLayout, node: int, first: int, x: np.ndarray) -> tuple:
    """The compute step of `node` with the implementation x picks among its columns from `first`."""
    chosen = [l for l in range(1, len(L.impl[node].names)) if x[first + l - 1] > 0.5]
    return ("compute", node, L.impl[node].names[chosen[0]]) if chosen else ("compute", node)


def schedule_from_solution(L: MonetLayout, x: np.ndarray) -> list[tuple]:
    """Algorithms 1-2: the forward pass with its implementations, then per backward node its
    recomputations in forward order and the node itself."""
    fwd, bwd = L.fwd.tolist(), L.bwd.tolist()
    out = [_chosen(L, node, int(L.df[i]), x) for i, node in enumerate(fwd)]
    for k, node in enumerate(bwd):
        for i in np.flatnonzero(L.r[k] >= 0).tolist():
            if x[L.r[k, i]] > 0.5:
                out.append(_chosen(L, fwd[i], int(L.dr[k, i]), x))
        out.append(_chosen(L, node, int(L.db[k]), x))
    return out


def integer_assignment(L: MonetLayout, schedule: list) -> np.ndarray | None:
    """The integer columns (impls, r, s) of a schedule in MONeT's space (forward pass once in order,
    then per backward node in order its recomputations in forward order), s minimal (a copy is kept
    into stage k when it was made before stage k and is read in stage k or later); None when the
    schedule is not in that space. The continuous columns are left to `complete_start`."""
    problem = L.problem
    steps = normalize_schedule(schedule)
    computes = [(i, st) for i, st in enumerate(steps) if "compute" in st]
    N, K = L.N, L.K
    if len(computes) < N or [st["compute"] for _, st in computes[:N]] != L.fwd.tolist():
        return None
    x = np.zeros(L.num_vars)
    fpos = {int(n): i for i, n in enumerate(L.fwd)}
    bpos = {int(n): k for k, n in enumerate(L.bwd)}

    def impl_index(node: int, st: dict) -> int:
        name = st.get("impl") or "default"
        return L.impl[node].names.index(name)

    for i, (_, st) in enumerate(computes[:N]):
        l = impl_index(st["compute"], st)
        if l:
            x[L.df[i] + l - 1] = 1.0
    stage_start = np.zeros(K, dtype=np.int64)
    k, last = 0, -1
    first_of_stage = True
    for idx, st in computes[N:]:
        node = st["compute"]
        if first_of_stage:
            if k >= K:
                return None
            stage_start[k] = idx
            first_of_stage = False
        if node in bpos:
            if bpos[node] != k:
                return None
            l = impl_index(node, st)
            if l:
                x[L.db[k] + l - 1] = 1.0
            k, last, first_of_stage = k + 1, -1, True
            continue
        i = fpos[node]
        if i <= last or L.r[k, i] < 0:
            return None
        last = i
        x[L.r[k, i]] = 1.0
        l = impl_index(node, st)
        if l:
            x[L.dr[k, i] + l - 1] = 1.0
    if k != K:
        return None
    sim = simulate(problem, schedule)
    a_of = {int(v): a for a, v in enumerate(L.vals.tolist())}
    for cidx in range(len(sim.copy_value)):
        a = a_of.get(int(sim.copy_value[cidx]))
        if a is None:
            continue
        kept = (sim.copy_start[cidx] < stage_start) & (sim.copy_end[cidx] >= stage_start)
        for kk in np.flatnonzero(kept).tolist():
            if L.s[kk, a] < 0:
                return None
            x[L.s[kk, a]] = 1.0
    return x


def complete_start(model: MilpModel, L: MonetLayout, x_int: np.ndarray, threads: int | None = None) -> np.ndarray | None:
    """A full start from fixed integer columns: the continuous columns by an LP (on `threads`) with the
    integers fixed (they are determined up to slack); None when the integers violate the model."""
    from memplan.tasks.solve.core.milp import MilpOptions, solve_milp

    n_int = L.num_vars
    lo, hi = model.col_lower.copy(), model.col_upper.copy()
    lo[:n_int] = x_int
    hi[:n_int] = x_int
    fixed = MilpModel(np.zeros(model.num_variables), model.A, model.row_lower, model.row_upper, lo, hi,
                      np.zeros(model.num_variables, dtype=bool))
    res = solve_milp(fixed, MilpOptions(backend="highs", relax=True, time_limit=30.0, threads=threads))
    if res.x is None:
        return None
    x = res.x.copy()
    x[:n_int] = x_int
    return x
