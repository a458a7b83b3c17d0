"""The MONeT 0-1 program (Gupta/Shah et al., ICLR 2021, sec. 4 and appendices B-C) on the joint operator graph.

Mapping of the paper's per-layer formulation onto our forward+backward operator graph
---------------------------------------------------------------------------------------
The paper has forward operators i = 1..N and one backward operator k per layer. Our graph is one list of
ATen nodes: the *forward pass* is every recomputable (forward and loss) node in the default order
(positions i = 0..N-1), and every *backward node* in the default order is a stage k = 0..K-1 (the
paper's backward_k, visited in the order the graph runs them). The schedule space is the paper's
Algorithms 1-2: the forward pass runs each forward node once with implementation delta_i; before backward
node k runs (with implementation hat-delta_k) some forward nodes are recomputed in forward order
(r_i^k, implementation delta_i^k). Stored tensors are per value, not per node (a node may output
several values): s_v^0 is the paper's s^N (kept by the forward pass), s_v^k the set S^k available
when stage k starts; values only a variant allocates (a ReLU mask) are values like any other, made
only when their producer runs that variant. Backward values (gradients) are made once and never
recomputed, so |hat-L_k| is a constant per stage (`G_k`); graph outputs made by forward nodes (the
loss, running statistics) are resident from their producer on (counted as constants; a recomputation
of their producer counts its outputs once more at that step: conservative). Memory is in units of the
budget and only the schedule-dependent part is a variable.

Exactness. eq. (12)'s local set L_i^k is quadratic in r; the paper bounds it by L-bar_i^k (appendix B:
every later consumer recomputed). We instead keep an exact linear form: a continuous y_{v,i}^k >= the
reading indicator of every consumer t >= i of v in stage k, >= w_v^k (v still live after the
recomputations), whose least value is exactly "v is live at recompute step i"; it has one entry per
pair of L-bar_i^k (the appendix-B set), so the model is no larger than the bound's. Likewise the product
hat-delta_{k,l} s_i^{k-1} of eq. (10) (sigma, linearized by C.4's alpha >= x_i + x_j - 1) appears only
on the left of <= rows with positive sign, so C.4's upper-bound rows are dropped and the sum over
implementations is written aggregated: w_v^k >= s_v^{k+1}, w_v^k >= sum_{l: v in D_k^l} hat-delta_{k,l}
(the same LP relaxation as sigma when one implementation lacks v). With these, the model's memory at a
minimal assignment (s only where a later step reads the copy) equals the simulator's at every step:
MONeT's optimum over this schedule space is exact (tests compare it with a brute force).

Row blocks (tasks/solve/monet/model.py `build_model`)
| block                               | rows                                                      | paper        |
|-------------------------------------|-----------------------------------------------------------|--------------|
| one implementation per step         | sum_l df_{i,l} <= 1; sum_l dr_{i,l}^k <= r_i^k; sum db <= 1| sec. 4 (sum_l delta = 1, = r) |
| forward availability                | s_v^0 <= made(v); variant inputs made in the forward pass | (7)          |
| recomputation inputs                | read_{i,v}^k <= s_v^k + made_v^k                          | (7) left     |
| only stored or recomputed is kept   | s_v^{k+1} <= s_v^k + made_v^k                             | (7) right    |
| backward dependencies D_k^l         | sum_{l: v in D_k^l} db_{k,l} <= s_v^k + made_v^k          | (8)          |
| live after recomputation            | w_v^k >= s_v^{k+1}, w_v^k >= sum_{l: v in D_k^l} db_{k,l}  | (10), C.4    |
| live at recompute step i            | y_{v,i}^k >= w_v^k, y_{v,i}^k >= read_{t,v}^k (t >= i)     | (12), app. B |
| prefix/suffix sums                  | A_i^k = sum_{p(v)>i} |v| s_v^k, B_i^k = sum_{c(v)<i} |v| w_v^k, F_i = sum_{c(v)<i} |v| s_v^0 | (1), (12) |
| forward memory                      | ws_i + |x_i| + const_i + F_i <= M                          | (1), (14)    |
| recomputation memory                | ws_i^k + |x_i^k| + G_k + A_i^k + B_i^k + sum |v| y_{v,i}^k <= M | (6), (12), (13), (14) |
| backward memory                     | hat-ws_k + |y_k| + G_k + B_N^k <= M                        | (5), (10), (14) |
| retention (hierarchical ladders)    | const + sum_v |v| s_v^0 <= B_ret                           | -            |
| objective                           | sum tau delta + sum hat-tau hat-delta + sum tau delta^k    | (9)          |

(12) and (13) are one row per (i, k): with r_i^k = 0 the step's workspace and output vanish and the row is
(13), the memory between two steps. p(v) is the producer's forward position, c(v) the last forward
position reading v (any implementation). Nodes and values that no backward node at stage >= k needs
(directly or through forward consumers) have no r or s at stage k.

In-place (C.3, eq. 15-16): the problem's variants carry no in-place implementations (a variant
allocates its outputs), so no q/p variables are built.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from tasks.solve.milp import MilpModel
from tasks.solve.problem import Problem, ProblemError
from tasks.solve.simulator import normalize_schedule, simulate


@dataclass
class _Impl:
    """Implementations of one node: names (default first), inputs, outputs, workspace, cost."""

    names: tuple[str, ...]
    ins: list[frozenset[int]]
    outs: list[frozenset[int]]
    ws: np.ndarray
    cost: np.ndarray


@dataclass
class MonetLayout:
    """Forward nodes `fwd` (position i), backward nodes `bwd` (stage k), variable forward values `vals`
    (index a: producer position p[a], last forward reader position c[a], last stage needing it
    lastk[a]); column tables hold -1 where a variable does not exist."""

    problem: Problem
    fwd: np.ndarray
    bwd: np.ndarray
    vals: np.ndarray
    p: np.ndarray
    c: np.ndarray
    lastk: np.ndarray
    nodelast: np.ndarray
    impl: dict[int, _Impl]
    unit: float
    df: dict[tuple[int, int], int]
    db: dict[tuple[int, int], int]
    r: np.ndarray
    dr: dict[tuple[int, int, int], int]
    s: np.ndarray
    num_vars: int

    @property
    def N(self) -> int:
        return len(self.fwd)

    @property
    def K(self) -> int:
        return len(self.bwd)


def _impls(problem: Problem, node: int) -> _Impl:
    vs = [problem.variant(node, name) for name in problem.impls(node)]
    return _Impl(tuple(v.name for v in vs), [frozenset(v.inputs) for v in vs], [frozenset(v.outputs) for v in vs],
                 np.array([v.workspace for v in vs], dtype=np.float64), np.array([v.cost for v in vs], dtype=np.float64))


def split_passes(problem: Problem) -> tuple[np.ndarray, np.ndarray]:
    """Forward (recomputable) and backward nodes in the default order; ProblemError when a forward
    node reads a backward node's value (the forward pass could not run first)."""
    order = problem.order
    rec = problem.is_recomputable[order]
    fwd, bwd = order[rec], order[~rec]
    is_bwd = ~problem.is_recomputable
    for node in fwd.tolist():
        for impl in problem.impls(node):
            for v in problem.variant(node, impl).inputs:
                prod = problem.value_producer[v]
                if prod >= 0 and is_bwd[prod]:
                    raise ProblemError(f"problem {problem.name!r}: forward {problem.node_label(node)} reads value {v} "
                                       f"of backward {problem.node_label(int(prod))}; MONeT runs the whole forward "
                                       f"pass first, so forward nodes may read only forward values and inputs.")
    return fwd, bwd


class _Rows:
    """Constraint rows as COO triplets."""

    def __init__(self) -> None:
        self.r: list[int] = []
        self.c: list[int] = []
        self.v: list[float] = []
        self.lo: list[float] = []
        self.hi: list[float] = []

    def add(self, terms: dict[int, float], lo: float, hi: float) -> int:
        row = len(self.lo)
        for col, coef in terms.items():
            if coef != 0.0:
                self.r.append(row)
                self.c.append(col)
                self.v.append(coef)
        self.lo.append(lo)
        self.hi.append(hi)
        return row

    def matrix(self, ncols: int) -> tuple[sp.csr_matrix, np.ndarray, np.ndarray]:
        A = sp.csr_matrix((np.asarray(self.v, dtype=np.float64), (np.asarray(self.r, dtype=np.int64),
                                                                   np.asarray(self.c, dtype=np.int64))),
                          shape=(len(self.lo), ncols))
        return A, np.asarray(self.lo, dtype=np.float64), np.asarray(self.hi, dtype=np.float64)


def layout(problem: Problem, budget: float) -> MonetLayout:
    """Index the passes, values and the integer columns (df, db, r, dr, s), pruned to the stages where
    each node or value can still be needed (module docstring)."""
    fwd, bwd = split_passes(problem)
    N, K = len(fwd), len(bwd)
    fpos = np.full(problem.num_nodes, -1, dtype=np.int64)
    fpos[fwd] = np.arange(N)
    bpos = np.full(problem.num_nodes, -1, dtype=np.int64)
    bpos[bwd] = np.arange(K)
    impl = {int(x): _impls(problem, int(x)) for x in problem.order}
    producer = problem.value_producer
    vals = np.array([v for v in range(problem.num_values) if producer[v] >= 0 and fpos[producer[v]] >= 0
                     and not problem.is_output[v]], dtype=np.int64)
    a_of = {int(v): a for a, v in enumerate(vals.tolist())}
    p = fpos[producer[vals]] if len(vals) else np.zeros(0, np.int64)
    c = p.copy()
    bk = np.full(len(vals), -1, dtype=np.int64)
    fw_readers: list[list[int]] = [[] for _ in vals]
    for x, im in impl.items():
        for v in set().union(*im.ins):
            a = a_of.get(v)
            if a is None:
                continue
            if fpos[x] >= 0:
                c[a] = max(c[a], fpos[x])
                fw_readers[a].append(int(fpos[x]))
            else:
                bk[a] = max(bk[a], bpos[x])
    lastk = bk.copy()
    nodelast = np.full(N, -1, dtype=np.int64)
    outs_of: list[list[int]] = [[] for _ in range(N)]
    for a in range(len(vals)):
        outs_of[p[a]].append(a)
    for i in range(N - 1, -1, -1):
        for a in outs_of[i]:
            lastk[a] = max([lastk[a], *(nodelast[t] for t in fw_readers[a])])
        nodelast[i] = max((lastk[a] for a in outs_of[i]), default=-1)
    col = 0
    df: dict[tuple[int, int], int] = {}
    for i, x in enumerate(fwd.tolist()):
        for l in range(1, len(impl[x].names)):
            df[(i, l)] = col
            col += 1
    db: dict[tuple[int, int], int] = {}
    for k, x in enumerate(bwd.tolist()):
        for l in range(1, len(impl[x].names)):
            db[(k, l)] = col
            col += 1
    r = np.full((K, N), -1, dtype=np.int64)
    exists = np.arange(K)[:, None] <= nodelast[None, :]
    r[exists] = col + np.arange(int(exists.sum()))
    col += int(exists.sum())
    dr: dict[tuple[int, int, int], int] = {}
    for k, i in zip(*np.nonzero(exists)):
        for l in range(1, len(impl[int(fwd[i])].names)):
            dr[(int(k), int(i), l)] = col
            col += 1
    s = np.full((K, len(vals)), -1, dtype=np.int64)
    exists = np.arange(K)[:, None] <= lastk[None, :]
    s[exists] = col + np.arange(int(exists.sum()))
    col += int(exists.sum())
    return MonetLayout(problem, fwd, bwd, vals, p, c, lastk, nodelast, impl, float(max(budget, 1)), df, db, r, dr, s, col)


def build_model(problem: Problem, budget: float, retained: float | None = None) -> tuple[MilpModel, MonetLayout]:
    """MONeT's program for `problem` under `budget` bytes (module docstring; `retained` adds the
    retention row const + sum |v| s_v^0 <= retained)."""
    L = layout(problem, budget)
    N, K, M = L.N, L.K, L.unit
    fwd, bwd, vals = L.fwd.tolist(), L.bwd.tolist(), L.vals
    nv = len(vals)
    vb = problem.value_bytes[vals].astype(np.float64) / M
    a_of = {int(v): a for a, v in enumerate(vals.tolist())}
    col = [L.num_vars]
    integer_until = L.num_vars

    def new(n: int) -> np.ndarray:
        out = np.arange(col[0], col[0] + n)
        col[0] += n
        return out

    rows = _Rows()
    cost_terms: dict[int, float] = {}
    offset = 0.0

    # -- expressions -----------------------------------------------------------------------------
    def indicator(im: _Impl, cols: list[int | None], base: int | None, v: int, sets: str) -> tuple[float, dict[int, float]]:
        """sum over implementations l with v in sets_l of delta_l, delta_default = base - sum others
        (base None: the constant 1)."""
        member = [v in s for s in getattr(im, sets)]
        terms: dict[int, float] = {}
        const = 0.0
        if member[0]:
            if base is None:
                const = 1.0
            else:
                terms[base] = 1.0
        for l in range(1, len(member)):
            coef = float(member[l]) - float(member[0])
            if coef:
                terms[cols[l]] = terms.get(cols[l], 0.0) + coef
        return const, terms

    def linear(im: _Impl, cols: list[int | None], base: int | None, values: np.ndarray) -> tuple[float, dict[int, float]]:
        """sum_l delta_l values[l] with delta_default = base - sum others (base None: 1)."""
        terms: dict[int, float] = {}
        const = 0.0
        if base is None:
            const = float(values[0])
        elif values[0]:
            terms[base] = float(values[0])
        for l in range(1, len(values)):
            if values[l] != values[0]:
                terms[cols[l]] = terms.get(cols[l], 0.0) + float(values[l] - values[0])
        return const, terms

    def out_bytes(im: _Impl) -> np.ndarray:
        return np.array([problem.value_bytes[list(o)].sum() if o else 0 for o in im.outs], dtype=np.float64) / M

    def add_into(dst: dict[int, float], src: dict[int, float], scale: float = 1.0) -> None:
        for k_, v_ in src.items():
            dst[k_] = dst.get(k_, 0.0) + scale * v_

    cost_unit = float(problem.cost.mean()) if problem.num_nodes and problem.cost.mean() > 0 else 1.0

    # forward pass implementation choice and cost (9, forward pass)
    fcols = [[None] + [L.df[(i, l)] for l in range(1, len(L.impl[x].names))] for i, x in enumerate(fwd)]
    for i, x in enumerate(fwd):
        im = L.impl[x]
        if len(im.names) > 1:
            rows.add({cc: 1.0 for cc in fcols[i][1:]}, -np.inf, 1.0)
        const, terms = linear(im, fcols[i], None, im.cost / cost_unit)
        offset += const
        add_into(cost_terms, terms)
    bcols = [[None] + [L.db[(k, l)] for l in range(1, len(L.impl[x].names))] for k, x in enumerate(bwd)]
    for k, x in enumerate(bwd):
        im = L.impl[x]
        if len(im.names) > 1:
            rows.add({cc: 1.0 for cc in bcols[k][1:]}, -np.inf, 1.0)
        const, terms = linear(im, bcols[k], None, im.cost / cost_unit)
        offset += const
        add_into(cost_terms, terms)

    def made(a: int, k: int | None) -> tuple[float, dict[int, float]]:
        """Indicator that the forward pass (k None) or stage k's recomputation makes value a."""
        i = int(L.p[a])
        x = fwd[i]
        if k is None:
            return indicator(L.impl[x], fcols[i], None, int(vals[a]), "outs")
        if L.r[k, i] < 0:
            return 0.0, {}
        return indicator(L.impl[x], rcols(k, i), int(L.r[k, i]), int(vals[a]), "outs")

    def rcols(k: int, i: int) -> list[int | None]:
        return [None] + [L.dr[(k, i, l)] for l in range(1, len(L.impl[fwd[i]].names))]

    # graph outputs made by forward nodes: resident from their producer on
    fconst = [v for v in range(problem.num_values) if problem.is_output[v] and problem.value_producer[v] >= 0
              and problem.is_recomputable[problem.value_producer[v]]]
    fpos = {x: i for i, x in enumerate(fwd)}
    const_from = np.zeros(N + 1)
    for v in fconst:
        const_from[fpos[int(problem.value_producer[v])] + 1] += problem.value_bytes[v] / M
    const_prefix = np.cumsum(const_from)                      # bytes of forward graph outputs made before i
    # gradients live during stage k (|hat L_k|): backward values made before k, read at k or later or outputs
    bpos = {x: k for k, x in enumerate(bwd)}
    G = np.zeros(K + 1)
    last_reader = {}
    for x in bwd:
        for v in set().union(*L.impl[x].ins):
            last_reader[v] = max(last_reader.get(v, -1), bpos[x])
    for v in range(problem.num_values):
        prod = int(problem.value_producer[v])
        if prod >= 0 and prod in bpos:
            j = bpos[prod]
            end = K - 1 if problem.is_output[v] else last_reader.get(v, j)
            if end > j:
                G[j + 1] += problem.value_bytes[v] / M
                G[end + 1] -= problem.value_bytes[v] / M
    G = np.cumsum(G)[:K] + const_prefix[N]

    # forward availability (7): s_v^0 only for values the chosen implementation makes; variant inputs
    for a in range(nv):
        if L.s.shape[0] and L.s[0, a] >= 0:
            const, terms = made(a, None)
            if const < 1.0:
                t = {int(L.s[0, a]): 1.0}
                add_into(t, terms, -1.0)
                rows.add(t, -np.inf, const)
    for i, x in enumerate(fwd):
        im = L.impl[x]
        for v in set().union(*im.ins):
            a = a_of.get(v)
            if a is None:
                continue
            rconst, rterms = indicator(im, fcols[i], None, v, "ins")
            mconst, mterms = made(a, None)
            if rterms or mterms or rconst > mconst:
                t = dict(rterms)
                add_into(t, mterms, -1.0)
                rows.add(t, -np.inf, mconst - rconst)

    # forward memory (1): ws + out + open values (constant) + kept closed values F_i + graph outputs
    open_fwd = np.zeros(N + 1)
    for a in range(nv):
        if L.c[a] > L.p[a]:
            open_fwd[L.p[a] + 1] += vb[a]
            open_fwd[L.c[a] + 1] -= vb[a]
    open_fwd = np.cumsum(open_fwd)
    by_close: list[list[int]] = [[] for _ in range(N + 1)]
    for a in range(nv):
        by_close[int(L.c[a]) + 1].append(a)
    Fcol = new(N + 1)
    for i in range(N + 1):
        t = {int(Fcol[i]): 1.0}
        if i:
            t[int(Fcol[i - 1])] = -1.0
        for a in by_close[i]:
            if L.s.shape[0] and L.s[0, a] >= 0:
                t[int(L.s[0, a])] = t.get(int(L.s[0, a]), 0.0) - vb[a]
        rows.add(t, 0.0, 0.0)
    budget_rows = []
    for i, x in enumerate(fwd):
        im = L.impl[x]
        const, terms = linear(im, fcols[i], None, im.ws / M + out_bytes(im))
        t = dict(terms)
        t[int(Fcol[i])] = 1.0
        budget_rows.append(rows.add(t, -np.inf, 1.0 - const - open_fwd[i] - const_prefix[i]))

    if retained is not None and K:
        t = {int(L.s[0, a]): float(vb[a]) for a in range(nv) if L.s[0, a] >= 0}
        rows.add(t, -np.inf, float(retained) / M - const_prefix[N])

    open_at: list[list[int]] = [[] for _ in range(N)]
    for a in range(nv):
        for i in range(int(L.p[a]) + 1, int(L.c[a]) + 1):
            open_at[i].append(a)
    by_prod: list[list[int]] = [[] for _ in range(N)]
    for a in range(nv):
        by_prod[int(L.p[a])].append(a)
    readers_of: list[list[int]] = [[] for _ in range(nv)]
    for i, x in enumerate(fwd):
        for v in set().union(*L.impl[x].ins):
            if v in a_of:
                readers_of[a_of[v]].append(i)

    for k, xb in enumerate(bwd):
        active = np.flatnonzero(L.r[k] >= 0)
        live = np.flatnonzero(L.s[k] >= 0)
        if not len(live) and not len(active):
            im = L.impl[xb]
            const, terms = linear(im, bcols[k], None, im.ws / M + out_bytes(im))
            budget_rows.append(rows.add(terms, -np.inf, 1.0 - const - G[k]))
            continue
        # recomputation implementation choice and cost (9, recomputation)
        for i in active.tolist():
            im = L.impl[fwd[i]]
            rc = rcols(k, i)
            if len(im.names) > 1:
                t = {cc: 1.0 for cc in rc[1:]}
                t[int(L.r[k, i])] = -1.0
                rows.add(t, -np.inf, 0.0)
            const, terms = linear(im, rc, int(L.r[k, i]), im.cost / cost_unit)
            add_into(cost_terms, terms)
        # recomputation inputs (7 left): read_{i,v}^k <= s_v^k + made_v^k
        for i in active.tolist():
            im = L.impl[fwd[i]]
            for v in set().union(*im.ins):
                a = a_of.get(v)
                if a is None:
                    continue
                _, t = indicator(im, rcols(k, i), int(L.r[k, i]), v, "ins")
                t = dict(t)
                t[int(L.s[k, a])] = t.get(int(L.s[k, a]), 0.0) - 1.0
                mconst, mterms = made(a, k)
                add_into(t, mterms, -1.0)
                rows.add(t, -np.inf, mconst)
        # only stored or recomputed values are kept (7 right)
        if k + 1 < K:
            for a in np.flatnonzero(L.s[k + 1] >= 0).tolist():
                t = {int(L.s[k + 1, a]): 1.0, int(L.s[k, a]): -1.0}
                mconst, mterms = made(a, k)
                add_into(t, mterms, -1.0)
                rows.add(t, -np.inf, mconst)
        # backward dependencies (8) and live-after-recomputation w (10, C.4)
        im_b = L.impl[xb]
        wcol = np.full(nv, -1, dtype=np.int64)
        wcol[live] = new(len(live))
        dep: dict[int, tuple[float, dict[int, float]]] = {}
        for v in set().union(*im_b.ins):
            a = a_of.get(v)
            if a is not None:
                dep[a] = indicator(im_b, bcols[k], None, v, "ins")
        for a, (dconst, dterms) in dep.items():
            t = {int(L.s[k, a]): -1.0}
            add_into(t, dterms)
            mconst, mterms = made(a, k)
            add_into(t, mterms, -1.0)
            rows.add(t, -np.inf, mconst - dconst)
            t = {int(wcol[a]): 1.0}
            add_into(t, dterms, -1.0)
            rows.add(t, dconst, np.inf)
        if k + 1 < K:
            for a in np.flatnonzero(L.s[k + 1] >= 0).tolist():
                rows.add({int(wcol[a]): 1.0, int(L.s[k + 1, a]): -1.0}, 0.0, np.inf)
        # suffix A_i = sum_{p(v) > i} |v| s_v^k, prefix B_i = sum_{c(v) < i} |v| w_v^k
        Acol = new(N)
        Bcol = new(N + 1)
        for i in range(N):
            t = {int(Acol[i]): 1.0}
            if i + 1 < N:
                t[int(Acol[i + 1])] = -1.0
                for a in by_prod[i + 1]:
                    if L.s[k, a] >= 0:
                        t[int(L.s[k, a])] = -vb[a]
            rows.add(t, 0.0, 0.0)
        for i in range(N + 1):
            t = {int(Bcol[i]): 1.0}
            if i:
                t[int(Bcol[i - 1])] = -1.0
            for a in by_close[i]:
                if wcol[a] >= 0:
                    t[int(wcol[a])] = t.get(int(wcol[a]), 0.0) - vb[a]
            rows.add(t, 0.0, 0.0)
        # recomputation memory (12)-(13) at each position i where something may run
        for i in active.tolist():
            im = L.impl[fwd[i]]
            rc = rcols(k, i)
            const, t = linear(im, rc, int(L.r[k, i]), im.ws / M + out_bytes(im))
            t = dict(t)
            t[int(Acol[i])] = 1.0
            t[int(Bcol[i])] = 1.0
            for a in open_at[i]:
                if wcol[a] >= 0:
                    y = int(new(1)[0])
                    t[y] = vb[a]
                    rows.add({y: 1.0, int(wcol[a]): -1.0}, 0.0, np.inf)
                    for tt in readers_of[a]:
                        if tt >= i and L.r[k, tt] >= 0:
                            _, rt = indicator(L.impl[fwd[tt]], rcols(k, tt), int(L.r[k, tt]), int(vals[a]), "ins")
                            row = {y: 1.0}
                            add_into(row, rt, -1.0)
                            rows.add(row, 0.0, np.inf)
            budget_rows.append(rows.add(t, -np.inf, 1.0 - G[k] - const))
        # backward memory (5)
        const, t = linear(im_b, bcols[k], None, im_b.ws / M + out_bytes(im_b))
        t = dict(t)
        t[int(Bcol[N])] = 1.0
        budget_rows.append(rows.add(t, -np.inf, 1.0 - G[k] - const))

    nvars = col[0]
    A, lo, hi = rows.matrix(nvars)
    c = np.zeros(nvars)
    for cc, v in cost_terms.items():
        c[cc] += v
    col_lo = np.zeros(nvars)
    col_hi = np.ones(nvars)
    col_hi[integer_until:] = np.inf
    integrality = np.zeros(nvars, dtype=bool)
    integrality[:integer_until] = True
    model = MilpModel(c, A, lo, hi, col_lo, col_hi, integrality, offset=offset, objective_scale=cost_unit,
                      budget_rows=np.asarray(budget_rows, dtype=np.int32))
    return model, L


def schedule_from_solution(L: MonetLayout, x: np.ndarray) -> list[tuple]:
    """Algorithms 1-2: the forward pass with its implementations, then per backward node its
    recomputations in forward order and the node itself."""
    def step(node: int, cols: list[int | None]) -> tuple:
        chosen = [l for l in range(1, len(cols)) if x[cols[l]] > 0.5]
        name = L.impl[node].names[chosen[0]] if chosen else None
        return ("compute", node) if name is None else ("compute", node, name)

    fwd, bwd = L.fwd.tolist(), L.bwd.tolist()
    out = [step(node, [None] + [L.df[(i, l)] for l in range(1, len(L.impl[node].names))]) for i, node in enumerate(fwd)]
    for k, node in enumerate(bwd):
        for i in np.flatnonzero(L.r[k] >= 0).tolist():
            if x[L.r[k, i]] > 0.5:
                out.append(step(fwd[i], [None] + [L.dr[(k, i, l)] for l in range(1, len(L.impl[fwd[i]].names))]))
        out.append(step(node, [None] + [L.db[(k, l)] for l in range(1, len(L.impl[node].names))]))
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
            x[L.df[(i, l)]] = 1.0
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
                x[L.db[(k, l)]] = 1.0
            k, last, first_of_stage = k + 1, -1, True
            continue
        i = fpos[node]
        if i <= last or L.r[k, i] < 0:
            return None
        last = i
        x[L.r[k, i]] = 1.0
        l = impl_index(node, st)
        if l:
            x[L.dr[(k, i, l)]] = 1.0
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


def complete_start(model: MilpModel, L: MonetLayout, x_int: np.ndarray) -> np.ndarray | None:
    """A full start from fixed integer columns: the continuous columns by an LP with the integers
    fixed (they are determined up to slack); None when the integers violate the model."""
    from tasks.solve.milp import MilpOptions, solve_milp

    n_int = L.num_vars
    lo, hi = model.col_lower.copy(), model.col_upper.copy()
    lo[:n_int] = x_int
    hi[:n_int] = x_int
    fixed = MilpModel(np.zeros(model.num_variables), model.A, model.row_lower, model.row_upper, lo, hi,
                      np.zeros(model.num_variables, dtype=bool))
    res = solve_milp(fixed, MilpOptions(backend="highs", relax=True, time_limit=30.0))
    if res.x is None:
        return None
    x = res.x.copy()
    x[:n_int] = x_int
    return x
