"""Checkmate's MILP (Jain et al. 2020, eq. 9) built as sparse matrices, and its link to schedules.

Stages t = 0..n-1 follow the default order: node order[t] is first computed in stage t (eq. 8a), only
earlier nodes run in stage t (8c) and nothing is retained into stage 0 (8b). Indices below are order
positions. The model is value-level so that multi-output nodes and graph outputs follow the simulator:

- R[t,k] in {0,1}: node k runs in stage t (k <= t).
- S[t,v] in {0,1}: value v is retained into stage t (producer position < t). Graph outputs: S = 1.
- FREE[t,v,k]: v is freed after node k runs in stage t, for k a user of v, and for k = producer of v
  when the node has several outputs or v no users (eq. 4 with the eliminations of 4.8: FREE of a
  single-output node's own value after itself is dropped, as is any FREE after the stage's last node).
- U[t,k] >= 0: memory while node k runs in stage t:
  U[t,0] = sum_v M_v S[t,v] + M_0 R[t,0]                               (eq. 2, no constant overhead)
  U[t,k] = U[t,k-1] - sum_v M_v FREE[t,v,k-1] + M_k R[t,k]              (eq. 3-4)
  U[t,k] + W_k R[t,k] <= budget                                         (eq. 9, W = workspace)
- eq. 1b: R[t,j] <= R[t,i] + S[t,v] for v produced by i, read by j; eq. 1c: S[t,v] <= R[t-1,i] + S[t-1,v].
- optional retention limit (Rockmate's block ILP, Zhao et al. 2023): sum_v M_v S[t*,v] <= B_ret, the
  bytes retained into stage t* (a block's first backward stage: what it holds while the other blocks run).
- FREE linearization, `formulation="paper"`: eq. 7a-7c with num_hazards(t,v,k) = (1 - R[t,k])
  + S[t+1,v] + sum_{users j > k} R[t,j] and FREE binary. `formulation="tight"`: FREE <= 1 - h for each
  hazard h separately and FREE continuous in [0,1]; (7b) is dropped, since freeing less never helps a
  solution, so optimal objectives are equal while the LP relaxation is tighter.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from memplan.tasks.solve.core.milp import MilpModel
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import normalize_schedule

log = logging.getLogger("memplan.solve")

FORMULATIONS = ("paper", "tight")


def expand_ranges(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For items i with integer ranges [lo_i, hi_i): (item index, value) of every member."""
    counts = np.maximum(hi - lo, 0)
    item = np.repeat(np.arange(len(lo)), counts)
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    return item, np.arange(counts.sum()) - starts + np.repeat(lo, counts)


def _tri(t: np.ndarray, k: np.ndarray | int) -> np.ndarray:
    return t * (t + 1) // 2 + k


@dataclass
class CheckmateLayout:
    """Where each variable family lives in the model's column vector, plus the expanded index arrays.

    Values are the graph's produced values (`vals`, compact index iv); `pp[iv]` is the producer's
    position, `mb[iv]` its bytes. FREE pairs e are (fv[e], fk[e]); `later` triples (te, tj) list the
    users j > fk[e] of fv[e]."""

    n: int
    order: np.ndarray
    vals: np.ndarray
    pp: np.ndarray
    mb: np.ndarray
    node_bytes: np.ndarray
    edge_v: np.ndarray
    edge_k: np.ndarray
    fv: np.ndarray
    fk: np.ndarray
    later_e: np.ndarray
    later_j: np.ndarray
    s_start: np.ndarray
    f_start: np.ndarray
    s_base: int
    f_base: int
    u_base: int
    num_vars: int
    unit: float = 1.0

    def r(self, t, k):
        return _tri(np.asarray(t), np.asarray(k))

    def s(self, t, iv):
        return self.s_base + self.s_start[iv] + np.asarray(t) - self.pp[iv] - 1

    def f(self, t, e):
        return self.f_base + self.f_start[e] + np.asarray(t) - self.fk[e] - 1

    def u(self, t, k):
        return self.u_base + _tri(np.asarray(t), np.asarray(k))


def layout(problem: Problem) -> CheckmateLayout:
    """Index the model's variables: edges (value, reading position), FREE pairs (eq. 4 with the 4.8
    eliminations: user pairs of freeable values, plus the producer pair of multi-output or unread values)
    and, per pair, the later users that are its hazards (eq. 5)."""
    n = problem.num_nodes
    order, pos = problem.order, problem.position
    producer = problem.value_producer
    vals = np.flatnonzero(producer >= 0)
    iv_of = np.full(problem.num_values, -1, dtype=np.int64)
    iv_of[vals] = np.arange(len(vals))
    pp = pos[producer[vals]]
    edge_v_parts: list[np.ndarray] = []
    edge_k_parts: list[np.ndarray] = []
    for k, node in enumerate(order.tolist()):
        ivs = iv_of[list(problem.node_inputs[node])] if problem.node_inputs[node] else np.zeros(0, np.int64)
        ivs = ivs[ivs >= 0]
        edge_v_parts.append(ivs)
        edge_k_parts.append(np.full(len(ivs), k, dtype=np.int64))
    edge_v = np.concatenate(edge_v_parts) if edge_v_parts else np.zeros(0, np.int64)
    edge_k = np.concatenate(edge_k_parts) if edge_k_parts else np.zeros(0, np.int64)
    freeable = ~problem.is_output[vals]
    multi = np.array([len(problem.node_outputs[p]) > 1 for p in producer[vals]], dtype=bool)
    count = np.bincount(edge_v, minlength=len(vals))
    own = np.flatnonzero(freeable & (multi | (count == 0)))
    user_pairs = freeable[edge_v]
    fv = np.concatenate([edge_v[user_pairs], own])
    fk = np.concatenate([edge_k[user_pairs], pp[own]])
    # users j of fv[e] with j > fk[e]: join pairs with edges on the value, keep later ones
    by_value = np.argsort(edge_v, kind="stable")
    first = np.searchsorted(edge_v[by_value], np.arange(len(vals)))
    e_idx, slot = expand_ranges(np.zeros(len(fv), np.int64), count[fv])
    j = edge_k[by_value[first[fv[e_idx]] + slot]]
    keep = j > fk[e_idx]
    s_count = n - 1 - pp
    f_count = np.maximum(n - 1 - fk, 0)
    s_base = n * (n + 1) // 2
    f_base = s_base + int(s_count.sum())
    u_base = f_base + int(f_count.sum())
    return CheckmateLayout(
        n=n, order=order, vals=vals, pp=pp, mb=problem.value_bytes[vals].astype(np.float64),
        node_bytes=problem.node_bytes[order].astype(np.float64), edge_v=edge_v, edge_k=edge_k, fv=fv, fk=fk,
        later_e=e_idx[keep], later_j=j[keep],
        s_start=np.cumsum(s_count) - s_count, f_start=np.cumsum(f_count) - f_count,
        s_base=s_base, f_base=f_base, u_base=u_base, num_vars=u_base + n * (n + 1) // 2)


class _Rows:
    """Accumulates constraint rows as COO triplets."""

    def __init__(self) -> None:
        self.rows: list[np.ndarray] = []
        self.cols: list[np.ndarray] = []
        self.vals: list[np.ndarray] = []
        self.lo: list[np.ndarray] = []
        self.hi: list[np.ndarray] = []
        self.count = 0

    def block(self, num: int, lo: float | np.ndarray, hi: float | np.ndarray) -> int:
        start = self.count
        self.count += num
        self.lo.append(np.broadcast_to(np.asarray(lo, dtype=np.float64), (num,)))
        self.hi.append(np.broadcast_to(np.asarray(hi, dtype=np.float64), (num,)))
        return start

    def add(self, rows: np.ndarray, cols: np.ndarray, vals: float | np.ndarray) -> None:
        rows, cols = np.asarray(rows, np.int64), np.asarray(cols, np.int64)
        self.rows.append(rows)
        self.cols.append(cols)
        self.vals.append(np.broadcast_to(np.asarray(vals, dtype=np.float64), rows.shape))

    def matrix(self, num_cols: int) -> tuple[sp.csr_matrix, np.ndarray, np.ndarray]:
        A = sp.csr_matrix((np.concatenate(self.vals), (np.concatenate(self.rows), np.concatenate(self.cols))),
                          shape=(self.count, num_cols))
        return A, np.concatenate(self.lo), np.concatenate(self.hi)


def build_model(problem: Problem, budget: float, formulation: str = "tight",
                retained: tuple[int, float] | None = None) -> tuple[MilpModel, CheckmateLayout]:
    """The MILP of eq. (9) for `problem` under `budget` bytes; `retained = (t*, B_ret)` adds the retention
    limit sum_v M_v S[t*,v] <= B_ret (module docstring)."""
    if formulation not in FORMULATIONS:
        raise ValueError(f"formulation {formulation!r} is unknown; choose one of {', '.join(FORMULATIONS)}.")
    L = layout(problem)
    L.unit = float(max(budget, 1))
    n, N = L.n, L.num_vars
    cost = problem.cost[L.order].astype(np.float64)
    work = problem.workspace[L.order].astype(np.float64)
    rows = _Rows()
    sv, st = expand_ranges(L.pp + 1, np.full(len(L.pp), n))                          # S variables (st, sv)
    ut, uk = expand_ranges(np.zeros(n, np.int64), np.arange(1, n + 1))                # R and U variables (ut, uk)

    # eq. 1b: R[t,k] - R[t,pp(v)] - S[t,v] <= 0 for every edge (v, k) and stage t >= k
    e, t = expand_ranges(L.edge_k, np.full(len(L.edge_k), n))
    r0 = rows.block(len(e), -np.inf, 0.0) + np.arange(len(e))
    v, k = L.edge_v[e], L.edge_k[e]
    rows.add(r0, L.r(t, k), 1.0)
    rows.add(r0, L.r(t, L.pp[v]), -1.0)
    rows.add(r0, L.s(t, v), -1.0)

    # eq. 1c: S[t,v] - R[t-1,pp(v)] - S[t-1,v] <= 0 (S[pp(v), v] = 0 by 8b)
    v, t = sv, st
    r0 = rows.block(len(v), -np.inf, 0.0) + np.arange(len(v))
    rows.add(r0, L.s(t, v), 1.0)
    rows.add(r0, L.r(t - 1, L.pp[v]), -1.0)
    carried = t - 1 > L.pp[v]
    rows.add(r0[carried], L.s(t[carried] - 1, v[carried]), -1.0)

    # eq. 2-4: U recurrence, one equality per (t, k), row index = tri(t, k)
    t, k = ut, uk
    u0 = rows.block(len(t), 0.0, 0.0)
    urow = u0 + _tri(t, k)
    rows.add(urow, L.u(t, k), 1.0)
    rows.add(urow, L.r(t, k), -L.node_bytes[k] / L.unit)
    later = k > 0
    rows.add(urow[later], L.u(t[later], k[later] - 1), -1.0)
    rows.add(u0 + _tri(st, 0), L.s(st, sv), -L.mb[sv] / L.unit)
    e, tf = expand_ranges(L.fk + 1, np.full(len(L.fk), n))
    rows.add(u0 + _tri(tf, L.fk[e] + 1), L.f(tf, e), L.mb[L.fv[e]] / L.unit)

    # eq. 9 with workspace: U[t,k] + W_k R[t,k] <= budget (U <= budget is a column bound); memory is
    # measured in units of the budget so that coefficients stay near 1
    busy = work[k] > 0
    budget_rows = rows.block(int(busy.sum()), -np.inf, 1.0) + np.arange(int(busy.sum()))
    rows.add(budget_rows, L.u(t[busy], k[busy]), 1.0)
    rows.add(budget_rows, L.r(t[busy], k[busy]), work[k[busy]] / L.unit)

    if retained is not None:
        stage, limit = retained
        held = np.flatnonzero(st == stage)
        scale = max(float(limit), float(L.mb[sv[held]].min(initial=1.0)), 1.0)   # coefficients near 1
        limit_row = rows.block(1, -np.inf, float(limit) / scale)
        rows.add(np.full(len(held), limit_row), L.s(st[held], sv[held]), L.mb[sv[held]] / scale)

    # FREE linearization; the F variable (tf, e) has hazards R[tf, fk], S[tf+1, fv], R[tf, j > fk]
    fcol = L.f(tf, e)
    has_next = tf + 1 < n
    le, tl = expand_ranges(np.maximum(L.later_j, L.fk[L.later_e] + 1), np.full(len(L.later_j), n))
    lfcol = L.f(tl, L.later_e[le])
    lrcol = L.r(tl, L.later_j[le])
    if formulation == "tight":
        r0 = rows.block(len(e), -np.inf, 0.0) + np.arange(len(e))             # FREE <= R[t,k]
        rows.add(r0, fcol, 1.0)
        rows.add(r0, L.r(tf, L.fk[e]), -1.0)
        m = int(has_next.sum())
        r0 = rows.block(m, -np.inf, 1.0) + np.arange(m)                         # FREE <= 1 - S[t+1,v]
        rows.add(r0, fcol[has_next], 1.0)
        rows.add(r0, L.s(tf[has_next] + 1, L.fv[e[has_next]]), 1.0)
        r0 = rows.block(len(le), -np.inf, 1.0) + np.arange(len(le))             # FREE <= 1 - R[t,j]
        rows.add(r0, lfcol, 1.0)
        rows.add(r0, lrcol, 1.0)
    else:
        kappa = 1.0 + has_next + np.bincount(lfcol - L.f_base, minlength=len(e))[fcol - L.f_base]
        lrow = lfcol - L.f_base                                                  # row of F var within block
        hazard_blocks: tuple[tuple[float, float, float | np.ndarray], ...] = (
            (1.0, -np.inf, kappa - 1.0), (-1.0, -np.inf, 0.0))
        for sign, block_lo, block_hi in hazard_blocks:
            # (7c): -R[t,k] + S + sum R[t,j] + kappa FREE <= kappa - 1;  (7b): R - S - sum R - FREE <= 0
            first_row = rows.block(len(e), block_lo, block_hi)
            rows.add(first_row + np.arange(len(e)), fcol, kappa if sign > 0 else -1.0)
            rows.add(first_row + np.arange(len(e)), L.r(tf, L.fk[e]), -sign)
            rows.add(first_row + np.flatnonzero(has_next), L.s(tf[has_next] + 1, L.fv[e[has_next]]), sign)
            rows.add(first_row + lrow, lrcol, sign)

    A, lo, hi = rows.matrix(N)
    c = np.zeros(N)
    cost_unit = float(cost.mean()) if n and cost.mean() > 0 else 1.0
    c[L.r(ut, uk)] = cost[uk] / cost_unit
    col_lo, col_hi = np.zeros(N), np.ones(N)
    diag = L.r(np.arange(n), np.arange(n))
    col_lo[diag] = 1.0                                                           # eq. 8a
    outs = problem.is_output[L.vals][sv]
    col_lo[L.s(st, sv)[outs]] = 1.0                                              # graph outputs stay
    col_hi[L.u_base:] = float(budget) / L.unit
    integrality = np.zeros(N, dtype=bool)
    integrality[:L.f_base] = True
    if formulation == "paper":
        integrality[L.f_base:L.u_base] = True
    return MilpModel(c, A, lo, hi, col_lo, col_hi, integrality, objective_scale=cost_unit,
                     budget_rows=budget_rows, budget_cols=np.arange(L.u_base, N)), L


def schedule_from_solution(L: CheckmateLayout, x: np.ndarray) -> list[tuple[str, int]]:
    """Algorithm 1: a row-major scan of R (stage by stage, nodes in order); frees are left to the
    simulator, which releases each value after its last use (at or before FREE's point)."""
    t, k = expand_ranges(np.zeros(L.n, np.int64), np.arange(1, L.n + 1))
    run = x[L.r(t, k)] > 0.5
    return [("compute", int(node)) for node in L.order[k[run]]]


def assignment_from_schedule(problem: Problem, L: CheckmateLayout, schedule: list) -> np.ndarray | None:
    """A full (R, S, FREE, U) assignment reproducing a frontier-advancing schedule (stage t ends with
    the first computation of node order[t], each stage runs nodes in increasing order): S[t,v] = 1 when
    a copy of v made before stage t is read in stage t or later, FREE from eq. (5), U from eq. (2-3).
    Its U equals the simulator's memory, so it satisfies the budget when the schedule does. None when
    the schedule is not frontier-advancing."""
    n, pos = L.n, problem.position
    iv_of = np.full(problem.num_values, -1, dtype=np.int64)
    iv_of[L.vals] = np.arange(len(L.vals))
    x = np.zeros(L.num_vars)
    stage, last_k = 0, -1
    copy_stage = np.full(len(L.vals), -1, dtype=np.int64)
    last_read = np.full(len(L.vals), -1, dtype=np.int64)
    spans: list[tuple[int, int, int]] = []
    for step in normalize_schedule(schedule):
        if "compute" not in step:
            continue
        node = step["compute"]
        k = int(pos[node])
        if stage >= n or k > stage or k <= last_k:
            return None
        x[L.r(stage, k)] = 1.0
        ins = iv_of[list(problem.node_inputs[node])] if problem.node_inputs[node] else np.zeros(0, np.int64)
        last_read[ins[ins >= 0]] = stage
        for iv in iv_of[list(problem.node_outputs[node])]:
            if copy_stage[iv] >= 0:
                spans.append((iv, copy_stage[iv], last_read[iv]))
            copy_stage[iv], last_read[iv] = stage, stage
        last_k = k
        if k == stage:
            stage, last_k = stage + 1, -1
    if stage != n:
        return None
    final = np.flatnonzero(copy_stage >= 0)
    ends = np.where(problem.is_output[L.vals][final], n - 1, last_read[final])
    spans.extend(zip(final.tolist(), copy_stage[final].tolist(), ends.tolist()))
    sp_v, sp_a, sp_b = (np.array(col, dtype=np.int64) for col in zip(*spans)) if spans else (np.zeros(0, np.int64),) * 3
    item, t = expand_ranges(sp_a + 1, sp_b + 1)
    x[L.s(t, sp_v[item])] = 1.0
    # FREE[t,e] = 1 iff no hazard: R[t,k], not S[t+1,v], no later user j of v runs in stage t
    e, tf = expand_ranges(L.fk + 1, np.full(len(L.fk), n))
    ok = x[L.r(tf, L.fk[e])] > 0.5
    nxt = tf + 1 < n
    ok[nxt] &= x[L.s(tf[nxt] + 1, L.fv[e[nxt]])] < 0.5
    le, tl = expand_ranges(np.maximum(L.later_j, L.fk[L.later_e] + 1), np.full(len(L.later_j), n))
    busy = x[L.r(tl, L.later_j[le])] > 0.5
    fcol = L.f(tf, e)
    blocked = np.zeros(len(e), dtype=bool)
    blocked[L.f(tl[busy], L.later_e[le[busy]]) - L.f_base] = True
    x[fcol] = (ok & ~blocked).astype(np.float64)
    # U by the recurrence: per-(t,k) increments, cumulative within each stage
    ut, uk = expand_ranges(np.zeros(n, np.int64), np.arange(1, n + 1))
    delta = x[L.r(ut, uk)] * L.node_bytes[uk]
    sv, st = expand_ranges(L.pp + 1, np.full(len(L.pp), n))
    np.add.at(delta, _tri(st, 0), x[L.s(st, sv)] * L.mb[sv])
    np.add.at(delta, _tri(tf, L.fk[e] + 1), -x[fcol] * L.mb[L.fv[e]])
    total = np.cumsum(delta)
    row_start = _tri(ut, 0)
    x[L.u(ut, uk)] = (total - np.concatenate([[0.0], total])[row_start]) / L.unit
    return x
