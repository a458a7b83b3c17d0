"""OLLA's tensor-lifetime ILP (Steiner et al. 2022, sec. 3.2 and 4.4, eq. 14) as sparse matrices.

Timesteps t = 0..n-1, one operator each. C[v, t] = 1 when node v runs at t, which creates all its
output edges at once (eq. 5 is built in: siblings share their source's variable). P[e, t] = 1 when
edge e is preserved in memory at t. Variables exist only inside the spans of sec. 4.1 (spans.py):
C[v, t] for t in SPAN(v) = [ASAP(v), ALAP(v)] (eq. 10), P[e, t] for t in MUL(e) = [ASAP(src(e)) + 1,
max ALAP of its sinks] (eq. 11), fixed to 1 on PRES(e) (eq. 12). Rows:

| block                  | rows                                                               | paper  |
|------------------------|--------------------------------------------------------------------|--------|
| create or preserve     | P[e,t] + C[src(e),t] <= 1: implied by eq. 2 and 3 (a preserved     | eq. 1  |
|                        | edge was created before, once), so these rows are left out         |        |
| preserve only if there | P[e,t] - P[e,t-1] - C[src(e),t-1] <= 0 (= 0 for graph outputs,     | eq. 2  |
|                        | which stay resident to the end of the step)                        |        |
| run once               | sum_t C[v,t] = 1                                                   | eq. 3  |
| one operator per step  | sum_v C[v,t] = 1                                                   | sec 3.1|
| inputs resident        | C[v,t] - P[f,t] <= 0 for every edge f in fi(v)                     | eq. 4  |
| peak                   | sum_v (out_bytes(v) + workspace(v)) C[v,t] + sum_e S_e P[e,t]      | eq. 13 |
|                        |   - peak <= 0                                                      |        |
| strengthening (ours)   | X[v,t] = X[v,t-1] + C[v,t] (v has run by t, continuous);           | -      |
|                        | P[e,t] >= X[src(e),t-1] - X[s,t-1] for each sink s of e: valid for |        |
|                        | every schedule, it lifts the LP bound (GPT-2 root: 0.79 -> 0.93 of best)        |

The objective is `peak` (eq. 14). Only C is declared integer: once C is integral, the least P meeting
eq. 2 and 4 is 0/1, and the peak row makes the optimum pick it, so the optimal peak is unchanged.
The live bytes of a step are the simulator's (tasks/solve/core/simulator.py: a value lives from its
creation through its last read, graph outputs to the end, the running node's workspace on top), so
the decoded order (Function 1) simulates to at most the ILP's peak. The pair pruning of sec. 4.2 is
for the location constraints of the joint ILP (eq. 9); we solve the split problem (sec. 4.4), whose
location ILP (location.py) separates exactly the copies the fixed schedule keeps live together.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from memplan.tasks.solve.core.remat_milp import expand_ranges
from memplan.tasks.solve.core.milp import MilpModel, MilpOptions, MilpResult, solve_milp
from memplan.tasks.solve.core.orders import keeps_random_order, memory_order
from memplan.tasks.solve.olla.spans import Edges, olla_edges
from memplan.tasks.solve.olla.window import window_search
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import simulate


WINDOW = 16
"""Nodes per window of the local search that starts the whole-graph ILP (window.py)."""
WINDOW_TIME_LIMIT = 10.0
"""Seconds for one window's ILP."""


@dataclass
class LifetimeLayout:
    """Column layout: C[v, t] at `c_start[v] + t - asap[v]`, P[e, t] at `p_start[e] + t - p_lo[e]`,
    X[v, t] at `x_start` + C's offset, then the peak. Bytes are in units of `unit`."""

    edges: Edges
    c_start: np.ndarray
    p_lo: np.ndarray
    p_start: np.ndarray
    x_start: int
    peak: int
    unit: float

    def c(self, v, t):
        return self.c_start[v] + np.asarray(t) - self.edges.asap[v]

    def x(self, v, t):
        return self.x_start + self.c(v, t)

    def p(self, e, t):
        return self.p_start[e] + np.asarray(t) - self.p_lo[e]


@dataclass
class LifetimeResult:
    """The best order found (a topological order of all nodes), its simulated peak, the whole-graph
    ILP's lower bound on the optimal peak (bytes), its status ("optimal", "time_limit", ...) and size,
    and where the order comes from: "ilp" (the whole-graph ILP improved on its start), "window" (the
    window search improved on the default order) or "default"."""

    order: list[int]
    peak_bytes: int
    bound_bytes: float | None
    status: str
    seconds: float
    backend: str
    num_variables: int
    num_constraints: int
    source: str


def build_lifetime_model(problem: Problem) -> tuple[MilpModel, LifetimeLayout]:
    """The ILP of eq. 14 with the reductions of sec. 4.1 (module docstring)."""
    E = olla_edges(problem)
    n = problem.num_nodes
    asap, alap = E.asap, E.alap
    span = alap - asap + 1
    c_start = np.concatenate([[0], np.cumsum(span)[:-1]]).astype(np.int64)
    num_c = int(span.sum())
    p_lo = asap[E.src] + 1
    p_hi = E.last_use
    p_len = np.maximum(p_hi - p_lo + 1, 0)
    p_start = num_c + np.concatenate([[0], np.cumsum(p_len)[:-1]]).astype(np.int64)
    x_start = num_c + int(p_len.sum())
    peak = x_start + num_c
    unit = max(1.0, float(max(E.size.max(initial=0), (problem.node_bytes + problem.workspace).max(initial=0))) / 1024)
    L = LifetimeLayout(E, c_start, p_lo, p_start, x_start, peak, unit)
    num_vars = peak + 1

    rows: list[np.ndarray] = []
    cols: list[np.ndarray] = []
    vals: list[np.ndarray] = []
    lower: list[np.ndarray] = []
    upper: list[np.ndarray] = []
    count = 0

    def block(r: np.ndarray, c: np.ndarray, v: np.ndarray, lo: np.ndarray, up: np.ndarray) -> None:
        nonlocal count
        rows.append(r + count)
        cols.append(c)
        vals.append(np.asarray(v, dtype=np.float64))
        lower.append(lo)
        upper.append(up)
        count += len(lo)

    # eq. 1 (P[e,t] + C[src(e),t] <= 1) is implied: P[e,t] = 1 needs a creation before t (eq. 2), and
    # eq. 3 allows one creation, so its rows are left out.
    # eq. 2: P[e,t] - P[e,t-1] - C[src,t-1] <= 0 (= 0 for graph outputs)
    e2, t2 = expand_ranges(p_lo, p_hi + 1)
    k = np.arange(len(e2))
    prev_p = t2 - 1 >= p_lo[e2]
    src2 = E.src[e2]
    prev_c = (t2 - 1 >= asap[src2]) & (t2 - 1 <= alap[src2])
    block(np.concatenate([k, k[prev_p], k[prev_c]]),
          np.concatenate([L.p(e2, t2), L.p(e2[prev_p], t2[prev_p] - 1), L.c(src2[prev_c], t2[prev_c] - 1)]),
          np.concatenate([np.ones(len(k)), -np.ones(prev_p.sum()), -np.ones(prev_c.sum())]),
          np.where(E.is_output[e2], 0.0, -np.inf), np.zeros(len(k)))

    # eq. 3: sum_t C[v,t] = 1
    v3, t3 = expand_ranges(asap, alap + 1)
    block(v3, L.c(v3, t3), np.ones(len(v3)), np.ones(n), np.ones(n))

    # one operator per timestep: sum_v C[v,t] = 1
    block(t3, L.c(v3, t3), np.ones(len(v3)), np.ones(n), np.ones(n))

    # eq. 4: C[v,t] - P[f,t] <= 0 for f in fi(v)
    reads = [(v, f) for v in range(n) for f in E.node_inputs[v]]
    if reads:
        rv, rf = (np.array(x, dtype=np.int64) for x in zip(*reads))
        i4, t4 = expand_ranges(asap[rv], alap[rv] + 1)
        k = np.arange(len(i4))
        block(np.concatenate([k, k]), np.concatenate([L.c(rv[i4], t4), L.p(rf[i4], t4)]),
              np.concatenate([np.ones(len(k)), -np.ones(len(k))]), np.full(len(k), -np.inf), np.zeros(len(k)))

    # strengthening (ours): X[v,t] = sum_{t' <= t} C[v,t'] and P[e,t] >= X[src,t-1] - X[s,t-1] per sink s
    block(np.concatenate([np.arange(len(v3)), np.arange(len(v3)), np.flatnonzero(t3 > asap[v3])]),
          np.concatenate([L.x(v3, t3), L.c(v3, t3), L.x(v3[t3 > asap[v3]], t3[t3 > asap[v3]] - 1)]),
          np.concatenate([np.ones(len(v3)), -np.ones(len(v3)), -np.ones(int((t3 > asap[v3]).sum()))]),
          np.zeros(len(v3)), np.zeros(len(v3)))
    pairs = [(e, s) for e, readers in enumerate(E.sinks) if not E.is_output[e] for s in readers]
    if pairs:
        pe, ps = (np.array(x, dtype=np.int64) for x in zip(*pairs))
        i5, t5 = expand_ranges(p_lo[pe], np.minimum(p_hi[pe], alap[ps]) + 1)
        e5, s5, src5 = pe[i5], ps[i5], E.src[pe[i5]]
        k = np.arange(len(i5))
        src_var = t5 - 1 < alap[src5]                  # else X[src, t-1] = 1
        snk_var = t5 - 1 >= asap[s5]                   # else X[s, t-1] = 0 (and t-1 < alap(s) here)
        block(np.concatenate([k, k[src_var], k[snk_var]]),
              np.concatenate([L.p(e5, t5), L.x(src5[src_var], t5[src_var] - 1), L.x(s5[snk_var], t5[snk_var] - 1)]),
              np.concatenate([np.ones(len(k)), -np.ones(int(src_var.sum())), np.ones(int(snk_var.sum()))]),
              np.where(src_var, 0.0, 1.0), np.full(len(k), np.inf))

    # eq. 13: live bytes at t <= peak
    step_bytes = (problem.node_bytes + problem.workspace) / unit
    block(np.concatenate([t3, t2, np.arange(n)]),
          np.concatenate([L.c(v3, t3), L.p(e2, t2), np.full(n, peak)]),
          np.concatenate([step_bytes[v3], E.size[e2] / unit, -np.ones(n)]),
          np.full(n, -np.inf), np.zeros(n))

    A = sp.csr_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(count, num_vars))
    A.eliminate_zeros()
    col_lower = np.zeros(num_vars)
    col_upper = np.ones(num_vars)
    first, last = E.must_preserve                               # eq. 12: P = 1 on PRES(e)
    ef, tf = expand_ranges(first, np.maximum(last + 1, first))
    col_lower[L.p(ef, tf)] = 1.0
    col_upper[peak] = np.inf
    c = np.zeros(num_vars)
    c[peak] = 1.0
    integrality = np.zeros(num_vars, dtype=bool)
    integrality[:num_c] = True
    model = MilpModel(c, A, np.concatenate(lower), np.concatenate(upper), col_lower, col_upper, integrality,
                      objective_scale=unit)
    return model, L


def assignment_from_order(problem: Problem, L: LifetimeLayout, order: list[int]) -> np.ndarray:
    """The model's variables for running the nodes in `order` (a topological order): each edge is
    preserved from the step after its creation through its last read (to the end for outputs)."""
    E, n = L.edges, problem.num_nodes
    pos = np.empty(n, dtype=np.int64)
    pos[np.asarray(order, dtype=np.int64)] = np.arange(n)
    x = np.zeros(L.peak + 1)
    x[L.c(np.arange(n), pos)] = 1.0
    v, t = expand_ranges(E.asap, E.alap + 1)
    x[L.x(v, t)] = t >= pos[v]
    created = pos[E.src]
    last = np.array([int(pos[list(r)].max()) if r else -1 for r in E.sinks], dtype=np.int64)
    last = np.where(E.is_output, n - 1, np.maximum(last, created))
    e, t = expand_ranges(created + 1, last + 1)
    x[L.p(e, t)] = 1.0
    live = np.zeros(n)
    np.add.at(live, pos, (problem.node_bytes + problem.workspace) / L.unit)
    np.add.at(live, t, E.size[e] / L.unit)
    x[L.peak] = live.max(initial=0.0)
    return x


def order_from_solution(L: LifetimeLayout, x: np.ndarray) -> list[int]:
    """Function 1: the nodes sorted by the timestep whose C is set."""
    n = L.edges.num_nodes
    v, t = expand_ranges(L.edges.asap, L.edges.alap + 1)
    value = x[L.c(v, t)]
    best = np.full(n, -1.0)
    step = np.zeros(n, dtype=np.int64)
    for vi, ti, xi in zip(v.tolist(), t.tolist(), value.tolist()):
        if xi > best[vi]:
            best[vi], step[vi] = xi, ti
    return np.argsort(step, kind="stable").tolist()


def lifetime_order(problem: Problem, *, time_limit: float | None = None, gap: float = 0.0, backend: str = "auto",
                   threads: int | None = None, warm_start: bool = True, window: int = WINDOW,
                   whole_graph: bool = True) -> LifetimeResult:
    """The operator order minimizing the peak (eq. 14). With `warm_start`, the whole-graph ILP starts
    from the better of the default order and the greedy memory order (core.orders.memory_order, when it keeps
    the random nodes' order) improved by the window search (window.py; graphs above `window` nodes, at
    most half the time limit, all of it without `whole_graph`); the best incumbent when the time limit
    stops the solver. Never worse than either order."""
    start = time.perf_counter()
    deadline = None if time_limit is None else start + time_limit
    default = [int(v) for v in problem.order]
    best, source = default, "default"
    greedy = memory_order(problem)
    if keeps_random_order(problem, greedy) and _peak(problem, greedy.tolist()) < _peak(problem, default):
        best, source = greedy.tolist(), "memory order"
    if warm_start and 0 < window < problem.num_nodes:
        def solve_window(sub: Problem, limit: float | None) -> list[int] | None:
            limit = WINDOW_TIME_LIMIT if limit is None else min(limit, WINDOW_TIME_LIMIT)
            return _solve(sub, None, limit, 0.0, backend, threads)[0]

        half = None if time_limit is None else start + time_limit / (2 if whole_graph else 1)
        searched = window_search(problem, best, solve_window, window, half)
        source = source if searched == best else "window"
        best = searched
    if not whole_graph:
        return LifetimeResult(best, _peak(problem, best), None, "skipped", time.perf_counter() - start, "-", 0, 0,
                              source)
    remaining = None if deadline is None else max(deadline - time.perf_counter(), 0.0)
    order, result, model = _solve(problem, best if warm_start else None, remaining, gap, backend, threads)
    peak = _peak(problem, best)
    found = None if order is None else _peak(problem, order)
    if found is not None and (found < peak or found == peak and not warm_start):
        best, peak, source = order, found, "ilp"
    return LifetimeResult(best, peak, result.bound, result.status, time.perf_counter() - start, result.backend,
                          model.num_variables, model.num_constraints, source)


def _solve(problem: Problem, start_order: list[int] | None, time_limit: float | None, gap: float, backend: str,
           threads: int | None) -> tuple[list[int] | None, MilpResult, MilpModel]:
    """The order of the lifetime ILP's solution (None without one), the MILP result and the model."""
    model, L = build_lifetime_model(problem)
    result = solve_milp(model, MilpOptions(
        backend=backend, time_limit=time_limit, gap=gap, threads=threads,
        mip_start=None if start_order is None else assignment_from_order(problem, L, start_order)))
    return (None if result.x is None else order_from_solution(L, result.x)), result, model


def _peak(problem: Problem, order: list[int]) -> int:
    return simulate(problem, [("compute", v) for v in order]).peak_bytes
