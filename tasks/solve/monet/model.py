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

Row blocks (`build_model`). Columns: the integer ones (`layout`: df, db, r, dr, s), then F_0..F_N, then per
stage k with any r or s: w^k, A^k, B^k, y^k. Each block is one set of COO triplets built by numpy index
arithmetic over these column tables (no per-variable loops); the blocks are stacked into one CSR matrix.
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
| in-place: overwritten value gone    | read_{t,a} + q_{i,a} <= 1 (t > i), D_k(a) + q_{i,a}^k <= 1, s_a^{next} + q_{i,a} <= 1 | C.3 (15), (16) |
| retention (hierarchical ladders)    | const + sum_v |v| s_v^0 <= B_ret                           | -            |
| objective                           | sum tau delta + sum hat-tau hat-delta + sum tau delta^k    | (9)          |

Built by `_implementation_rows` (first row, objective), `_forward_rows` (forward availability, F_i,
forward memory, retention), `_stage_rows` ((7), (8), w), `_in_place_rows` (C.3) and `_memory_rows` (A, B,
y, memory during the backward pass).

(12) and (13) are one row per (i, k): with r_i^k = 0 the step's workspace and output vanish and the row is
(13), the memory between two steps. p(v) is the producer's forward position, c(v) the last forward
position reading v (any implementation). Nodes and values that no backward node at stage >= k needs
(directly or through forward consumers) have no r or s at stage k.

In-place (C.3, eq. 15-16). An in-place implementation of forward node i (`Variant.overwrites`: its output
written into input a) is one more implementation l, so the paper's q_i^k is the sum of i's in-place
implementation columns that overwrite a (df in the forward pass, dr^k in stage k), and q <= r (16) is the
one-implementation row. Its memory is its outputs less the overwritten bytes: a is read by i, so a is counted
at step i exactly once (the forward pass's open values; y_{a,i}^k >= read_{i,a}^k in a stage), and the
in-place step's |x_i| - |a| is the simulator's (a's copy ends before the step, the output takes its bytes).
Instead of the paper's p_j^k (r_j^k unless overwritten, replacing r in (7)) a is made unavailable after step i
directly: no later reader t > i in the same pass or stage (read_{t,a} + q <= 1; MONeT recomputes in forward
order, so a cannot be made again after i within the stage), not stage k's backward node (D_k(a) + q^k <= 1),
not kept into the next stage (s_a^{k+1} + q^k <= 1, s_a^0 + q <= 1 for the forward pass: (15)'s
s <= 2 - 2q). In-place backward implementations are refused (`split_passes`). The model stays exact on
MONeT's space (tests compare it with a brute force on a graph with an in-place ReLU).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from memplan.tasks.solve.core.milp import MilpModel
from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.monet.layout import Impl, MonetLayout, layout, ragged


def _impl_terms(vals: np.ndarray, nimpl: np.ndarray, base: np.ndarray,
                start: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """sum_l delta_l vals[e, l] for each expression e (a step with nimpl[e] implementations), the default's
    delta_0 = base[e] - sum_{l>=1} delta_l (base -1: the constant 1) and delta_l the column start[e] + l - 1:
    (constant per e, then the terms as expression, column, coefficient; zero coefficients left out)."""
    const = np.where(base < 0, vals[:, 0], 0.0)
    m = (base >= 0) & (vals[:, 0] != 0)
    expr, col, coef = [np.flatnonzero(m)], [base[m]], [vals[m, 0]]
    for l in range(1, vals.shape[1]):
        d = vals[:, l] - vals[:, 0]
        m = (l < nimpl) & (d != 0)
        expr.append(np.flatnonzero(m))
        col.append(start[m] + l - 1)
        coef.append(d[m])
    return const, np.concatenate(expr), np.concatenate(col), np.concatenate(coef)


def _membership(impls: list[Impl], sets: str, a_of: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pairs (step j, variable value a) with a in the `sets` ("ins" or "outs") of some implementation of
    impls[j], sorted by (a, j), and their rows m[pair, l] = [a in sets of implementation l]."""
    j, v, l = [], [], []
    for pos, im in enumerate(impls):
        for li, members in enumerate(getattr(im, sets)):
            j += [pos] * len(members)
            v += list(members)
            l += [li] * len(members)
    j, v, l = (np.asarray(z, dtype=np.int64) for z in (j, v, l))
    keep = a_of[v] >= 0
    n = max(len(impls), 1)
    pairs, pair = np.unique(a_of[v[keep]] * n + j[keep], return_inverse=True)
    member = np.zeros((len(pairs), width))
    member[pair, l[keep]] = 1.0
    return pairs % n, pairs // n, member


def _padded(rows: list[np.ndarray], width: int) -> np.ndarray:
    """Per-implementation vectors of the steps as one zero-padded (steps, width) array."""
    out = np.zeros((len(rows), width))
    for e, row in enumerate(rows):
        out[e, :len(row)] = row
    return out


class _Rows:
    """Constraint rows, built block by block as COO triplets."""

    def __init__(self) -> None:
        self.n = 0
        self.parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.lo: list[np.ndarray] = []
        self.hi: list[np.ndarray] = []

    def block(self, n: int, lo: float | np.ndarray, hi: float | np.ndarray) -> np.ndarray:
        """Indices of n new rows lo <= . <= hi."""
        self.lo.append(np.broadcast_to(np.asarray(lo, dtype=np.float64), (n,)))
        self.hi.append(np.broadcast_to(np.asarray(hi, dtype=np.float64), (n,)))
        self.n += n
        return np.arange(self.n - n, self.n)

    def add(self, rows: np.ndarray, cols: np.ndarray, coefs: float | np.ndarray) -> None:
        """Entries coefs at (rows, cols), broadcast together."""
        rows, cols, coefs = np.broadcast_arrays(rows, cols, np.asarray(coefs, dtype=np.float64))
        self.parts.append((rows.ravel(), cols.ravel(), coefs.ravel()))

    def matrix(self, ncols: int) -> tuple[sp.csr_matrix, np.ndarray, np.ndarray]:
        r, c = (np.concatenate([np.zeros(0, np.int64), *(part[z] for part in self.parts)]) for z in range(2))
        v = np.concatenate([np.zeros(0), *(part[2] for part in self.parts)])
        A = sp.csr_matrix((v, (r, c)), shape=(self.n, ncols))
        A.sum_duplicates()
        A.eliminate_zeros()
        return A, np.concatenate([np.zeros(0), *self.lo]), np.concatenate([np.zeros(0), *self.hi])


@dataclass
class _Program:
    """Tables the row blocks index: per forward step i / backward stage k its implementations (nf, nb),
    cost (units of the mean cost) and memory (workspace + outputs, units of the budget) per implementation;
    forward reads (ri, ra, sorted by (a, i); `read[pair, l]`: implementation l reads a), backward reads D_k^l
    (bk, ba, `dep`), `made_in[a, l]`: p(a)'s implementation l makes a; G_k (|hat L_k| + forward graph
    outputs), `const_prefix[i]` (forward graph outputs made before i); the continuous columns: F_i
    (`Fcol`), per stage with any r or s (`full`) w_v^k (`wcol`), A_i^k and B_i^k (from `Abase[k]`,
    `Bbase[k]`), and y_{v,i}^k for the open pairs (oi, oa) (a open at i: p(a) < i <= c(a)), pair yj at
    stage yk in column ycol (yfirst[j] + k indexes pair j's y at stage k); in-place pairs (wi, wa) with
    `over[pair, l]`: implementation l of forward step wi overwrites value wa."""

    L: MonetLayout
    vb: np.ndarray
    nf: np.ndarray
    nb: np.ndarray
    cost_unit: float
    cost_f: np.ndarray
    cost_b: np.ndarray
    mem_f: np.ndarray
    mem_b: np.ndarray
    ri: np.ndarray
    ra: np.ndarray
    read: np.ndarray
    bk: np.ndarray
    ba: np.ndarray
    dep: np.ndarray
    made_in: np.ndarray
    G: np.ndarray
    const_prefix: np.ndarray
    live: np.ndarray
    full: np.ndarray
    Fcol: np.ndarray
    wcol: np.ndarray
    Abase: np.ndarray
    Bbase: np.ndarray
    oi: np.ndarray
    oa: np.ndarray
    yj: np.ndarray
    yk: np.ndarray
    ycol: np.ndarray
    yfirst: np.ndarray
    ncols: int
    wi: np.ndarray
    wa: np.ndarray
    over: np.ndarray

    def made(self, a: np.ndarray, k: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Indicator that the forward pass (k None) or stage k's recomputation makes value a, as
        `_impl_terms` (none where p(a) has no r at stage k)."""
        L = self.L
        i = L.p[a]
        if k is None:
            return _impl_terms(self.made_in[a], self.nf[i], np.full(len(a), -1), L.df[i])
        base = L.r[k, i]
        const, e, col, coef = _impl_terms(self.made_in[a], self.nf[i], base, L.dr[k, i])
        keep = base[e] >= 0
        return np.where(base >= 0, const, 0.0), e[keep], col[keep], coef[keep]


def _program(problem: Problem, L: MonetLayout) -> _Program:
    """The tables and continuous columns of MONeT's program on layout L (`_Program`)."""
    N, K, M = L.N, L.K, L.unit
    nv = len(L.vals)
    cost_unit = float(problem.cost.mean()) if problem.num_nodes and problem.cost.mean() > 0 else 1.0
    fim = [L.impl[x] for x in L.fwd.tolist()]
    bim = [L.impl[x] for x in L.bwd.tolist()]
    width = max([len(im.names) for im in fim + bim], default=1)

    def out_bytes(im: Impl) -> np.ndarray:        # an in-place output takes its input's bytes (C.3)
        return np.array([problem.value_bytes[list(o)].sum() - problem.value_bytes[list(w)].sum()
                         for o, w in zip(im.outs, im.over)], dtype=np.float64) / M

    a_of = np.full(problem.num_values, -1, dtype=np.int64)
    a_of[L.vals] = np.arange(nv)
    ri, ra, read = _membership(fim, "ins", a_of, width)
    bk, ba, dep = _membership(bim, "ins", a_of, width)
    _, oa, made_by = _membership(fim, "outs", a_of, width)
    made_in = np.zeros((nv, width))
    made_in[oa] = made_by
    wi, wa, over = _membership(fim, "over", a_of, width)      # (i, a): implementations of i overwriting a

    # graph outputs made by forward nodes: resident from their producer on
    fpos = np.full(problem.num_nodes, -1, dtype=np.int64)
    fpos[L.fwd] = np.arange(N)
    bpos = np.full(problem.num_nodes, -1, dtype=np.int64)
    bpos[L.bwd] = np.arange(K)
    producer = problem.value_producer
    prod_f = np.where(producer >= 0, fpos[producer], -1)
    prod_b = np.where(producer >= 0, bpos[producer], -1)
    vbytes = problem.value_bytes.astype(np.float64) / M
    fout = problem.is_output & (prod_f >= 0)
    const_from = np.zeros(N + 1)
    np.add.at(const_from, prod_f[fout] + 1, vbytes[fout])
    const_prefix = np.cumsum(const_from)
    # gradients live during stage k (|hat L_k|): backward values made before k, read at k or later or outputs
    last_reader = np.full(problem.num_values, -1, dtype=np.int64)
    for k, im in enumerate(bim):
        read_k = np.fromiter(set().union(*im.ins), dtype=np.int64)
        last_reader[read_k] = np.maximum(last_reader[read_k], k)
    grad = np.flatnonzero(prod_b >= 0)
    made_at = prod_b[grad]
    end = np.where(problem.is_output[grad], K - 1, np.where(last_reader[grad] >= 0, last_reader[grad], made_at))
    span = end > made_at
    G = np.zeros(K + 1)
    np.add.at(G, made_at[span] + 1, vbytes[grad[span]])
    np.add.at(G, end[span] + 1, -vbytes[grad[span]])
    G = np.cumsum(G)[:K] + const_prefix[N]

    # continuous columns: F_0..F_N, then per stage with any r or s: w (live values), A, B, y in (i, a) order
    live = L.s >= 0
    full = live.any(axis=1) | (L.r >= 0).any(axis=1)
    nlive = live.sum(axis=1)
    oa, off = ragged(L.c - L.p)
    oi = L.p[oa] + 1 + off
    order = np.lexsort((oa, oi))
    oi, oa = oi[order], oa[order]
    yj, yk = ragged(np.minimum(L.nodelast[oi], L.lastk[oa]) + 1)
    ny = np.bincount(yk, minlength=K)
    size = np.where(full, nlive + 2 * N + 1, 0) + ny
    wbase = L.num_vars + N + 1 + np.cumsum(size) - size
    Abase = wbase + nlive
    Bbase = Abase + N
    ybase = Bbase + N + 1
    by_stage = np.argsort(yk, kind="stable")
    ycol = np.empty(len(yk), dtype=np.int64)
    ycol[by_stage] = ybase[yk[by_stage]] + np.arange(len(yk)) - (np.cumsum(ny) - ny)[yk[by_stage]]
    per_pair = np.bincount(yj, minlength=len(oi))
    return _Program(
        L, problem.value_bytes[L.vals].astype(np.float64) / M,
        np.array([len(im.names) for im in fim], dtype=np.int64), np.array([len(im.names) for im in bim], dtype=np.int64),
        cost_unit, _padded([im.cost / cost_unit for im in fim], width), _padded([im.cost / cost_unit for im in bim], width),
        _padded([im.ws / M + out_bytes(im) for im in fim], width), _padded([im.ws / M + out_bytes(im) for im in bim], width),
        ri, ra, read, bk, ba, dep, made_in, G, const_prefix, live, full, L.num_vars + np.arange(N + 1),
        np.where(live, wbase[:, None] + np.cumsum(live, axis=1) - 1, -1), Abase, Bbase, oi, oa, yj, yk, ycol,
        np.cumsum(per_pair) - per_pair, L.num_vars + N + 1 + int(size.sum()), wi, wa, over)


def _implementation_rows(P: _Program, rows: _Rows) -> tuple[float, np.ndarray, np.ndarray]:
    """One implementation per step (sec. 4: sum_l delta = 1, written sum_{l>=1} df_{i,l} <= 1, sum db <= 1,
    sum_l dr_{i,l}^k <= r_i^k) and the objective (9): (constant, columns, coefficients)."""
    L, nf = P.L, P.nf
    offset, cols, coefs = 0.0, [], []
    for n, first, cost in ((nf, L.df, P.cost_f), (P.nb, L.db, P.cost_b)):
        multi = np.flatnonzero(n > 1)
        step, l = ragged(n[multi] - 1)
        rows.add(rows.block(len(multi), -np.inf, 1.0)[step], first[multi][step] + l, 1.0)
        const, _, col, coef = _impl_terms(cost, n, np.full(len(n), -1), first)
        offset += float(const.sum())
        cols.append(col)
        coefs.append(coef)
    k, i = np.nonzero(L.r >= 0)
    multi = np.flatnonzero(nf[i] > 1)
    step, l = ragged(nf[i[multi]] - 1)
    rws = rows.block(len(multi), -np.inf, 0.0)
    rows.add(rws[step], L.dr[k, i][multi][step] + l, 1.0)
    rows.add(rws, L.r[k, i][multi], -1.0)
    _, _, col, coef = _impl_terms(P.cost_f[i], nf[i], L.r[k, i], L.dr[k, i])
    return offset, np.concatenate([*cols, col]), np.concatenate([*coefs, coef])


def _forward_rows(P: _Program, rows: _Rows, retained: float | None) -> np.ndarray:
    """The forward pass: availability (7) (s_v^0 <= made(v); read_{i,v} <= made(v) for variant inputs),
    F_i = sum_{c(v)<i} |v| s_v^0 (1), memory (1), (14): ws_i + |x_i| + const_i + F_i <= M, and the
    retention row const + sum_v |v| s_v^0 <= retained. Returns the memory rows."""
    L, nf, vb = P.L, P.nf, P.vb
    N, K, s, p, c = L.N, L.K, L.s, L.p, L.c
    if K:
        a = np.flatnonzero(P.live[0] & (P.made_in[:, 0] < 1.0))
        const, e, col, coef = P.made(a, None)
        rws = rows.block(len(a), -np.inf, const)
        rows.add(rws, s[0, a], 1.0)
        rows.add(rws[e], col, -coef)
    rconst, re, rcol, rcoef = _impl_terms(P.read, nf[P.ri], np.full(len(P.ri), -1), L.df[P.ri])
    mconst, me, mcol, mcoef = P.made(P.ra, None)
    keep = (np.bincount(re, minlength=len(P.ri)) > 0) | (np.bincount(me, minlength=len(P.ri)) > 0) | (rconst > mconst)
    row_of = np.full(len(P.ri), -1)
    row_of[keep] = rows.block(int(keep.sum()), -np.inf, (mconst - rconst)[keep])
    rows.add(row_of[re[keep[re]]], rcol[keep[re]], rcoef[keep[re]])
    rows.add(row_of[me[keep[me]]], mcol[keep[me]], -mcoef[keep[me]])

    open_fwd = np.zeros(N + 1)                                 # values made and still to be read: constant
    opened = c > p
    np.add.at(open_fwd, p[opened] + 1, vb[opened])
    np.add.at(open_fwd, c[opened] + 1, -vb[opened])
    open_fwd = np.cumsum(open_fwd)
    rws = rows.block(N + 1, 0.0, 0.0)                          # F_i - F_{i-1} - sum_{c(v) = i-1} |v| s_v^0 = 0
    rows.add(rws, P.Fcol, 1.0)
    rows.add(rws[1:], P.Fcol[:-1], -1.0)
    if K:
        a = np.flatnonzero(P.live[0])
        rows.add(rws[c[a] + 1], s[0, a], -vb[a])
    const, e, col, coef = _impl_terms(P.mem_f, nf, np.full(N, -1), L.df)
    budget = rows.block(N, -np.inf, 1.0 - const - open_fwd[:N] - P.const_prefix[:N])
    rows.add(budget[e], col, coef)
    rows.add(budget, P.Fcol[:N], 1.0)
    if retained is not None and K:
        a = np.flatnonzero(P.live[0])
        rows.add(rows.block(1, -np.inf, float(retained) / L.unit - P.const_prefix[N])[np.zeros(len(a), np.int64)],
                 s[0, a], vb[a])
    return budget


def _stage_rows(P: _Program, rows: _Rows) -> None:
    """What each stage k keeps and reads: recomputation inputs (7 left) read_{i,v}^k <= s_v^k + made_v^k,
    kept values (7 right) s_v^{k+1} <= s_v^k + made_v^k, backward dependencies (8)
    sum_{l: v in D_k^l} db_{k,l} <= s_v^k + made_v^k, and live after recomputation (10, C.4)
    w_v^k >= sum_{l: v in D_k^l} db_{k,l}, w_v^k >= s_v^{k+1}."""
    L = P.L
    r, dr, s = L.r, L.dr, L.s
    q, k = ragged(L.nodelast[P.ri] + 1)
    i, a = P.ri[q], P.ra[q]
    rws = rows.block(len(q), -np.inf, 0.0)
    _, e, col, coef = _impl_terms(P.read[q], P.nf[i], r[k, i], dr[k, i])
    rows.add(rws[e], col, coef)
    rows.add(rws, s[k, a], -1.0)
    _, e, col, coef = P.made(a, k)
    rows.add(rws[e], col, -coef)

    k, a = np.nonzero(P.live[1:])
    rws = rows.block(len(k), -np.inf, 0.0)
    rows.add(rws, s[k + 1, a], 1.0)
    rows.add(rws, s[k, a], -1.0)
    _, e, col, coef = P.made(a, k)
    rows.add(rws[e], col, -coef)

    bk, ba = P.bk, P.ba
    dconst, de, dcol, dcoef = _impl_terms(P.dep, P.nb[bk], np.full(len(bk), -1), L.db[bk])
    rws = rows.block(len(bk), -np.inf, -dconst)
    rows.add(rws, s[bk, ba], -1.0)
    rows.add(rws[de], dcol, dcoef)
    _, e, col, coef = P.made(ba, bk)
    rows.add(rws[e], col, -coef)

    rws = rows.block(len(bk), dconst, np.inf)
    rows.add(rws, P.wcol[bk, ba], 1.0)
    rows.add(rws[de], dcol, -dcoef)
    rws = rows.block(len(k), 0.0, np.inf)
    rows.add(rws, P.wcol[k, a], 1.0)
    rows.add(rws, s[k + 1, a], -1.0)


def _memory_rows(P: _Program, rows: _Rows) -> np.ndarray:
    """Memory during the backward pass: A_i^k = sum_{p(v)>i} |v| s_v^k, B_i^k = sum_{c(v)<i} |v| w_v^k (12);
    recomputation (6), (12)-(14): ws_i^k + |x_i^k| + G_k + A_i^k + B_i^k + sum |v| y_{v,i}^k <= M at each
    r_i^k, with y_{v,i}^k >= w_v^k and y_{v,i}^k >= read_{t,v}^k for readers t >= i (app. B); backward
    (5), (10), (14): hat-ws_k + |y_k| + G_k + B_N^k <= M. Returns the memory rows."""
    L, vb = P.L, P.vb
    N, K, r, dr, s, p, c = L.N, L.K, L.r, L.dr, L.s, L.p, L.c
    fk = np.flatnonzero(P.full)
    stage_row = np.cumsum(P.full) - 1
    rws = rows.block(len(fk) * N, 0.0, 0.0).reshape(len(fk), N)  # A_i - A_{i+1} - sum_{p(v) = i+1} |v| s_v = 0
    rows.add(rws, P.Abase[fk][:, None] + np.arange(N), 1.0)
    rows.add(rws[:, :-1], P.Abase[fk][:, None] + np.arange(1, N), -1.0)
    k, a = np.nonzero(P.live & (p >= 1)[None, :])
    rows.add(rws[stage_row[k], p[a] - 1], s[k, a], -vb[a])
    rws = rows.block(len(fk) * (N + 1), 0.0, 0.0).reshape(len(fk), N + 1)  # B_i - B_{i-1} - sum_{c(v) = i-1} |v| w_v = 0
    rows.add(rws, P.Bbase[fk][:, None] + np.arange(N + 1), 1.0)
    rows.add(rws[:, 1:], P.Bbase[fk][:, None] + np.arange(N), -1.0)
    k, a = np.nonzero(P.live)
    rows.add(rws[stage_row[k], c[a] + 1], P.wcol[k, a], -vb[a])

    k, i = np.nonzero(r >= 0)
    budget_rec = rows.block(len(k), -np.inf, 1.0 - P.G[k])
    _, e, col, coef = _impl_terms(P.mem_f[i], P.nf[i], r[k, i], dr[k, i])
    rows.add(budget_rec[e], col, coef)
    rows.add(budget_rec, P.Abase[k] + i, 1.0)
    rows.add(budget_rec, P.Bbase[k] + i, 1.0)
    rec_row = np.full((K, N), -1, dtype=np.int64)
    rec_row[k, i] = budget_rec
    oi, oa, yj, yk = P.oi, P.oa, P.yj, P.yk
    rows.add(rec_row[yk, oi[yj]], P.ycol, vb[oa[yj]])
    rws = rows.block(len(yj), 0.0, np.inf)
    rows.add(rws, P.ycol, 1.0)
    rows.add(rws, P.wcol[yk, oa[yj]], -1.0)
    key = P.ra * N + P.ri                                      # forward reads, sorted
    lo = np.searchsorted(key, oa * N + oi)
    pair, off = ragged(np.searchsorted(key, oa * N + N) - lo)  # (open pair, read by t >= i of its value)
    q = lo[pair] + off
    h, k = ragged(np.minimum(np.minimum(L.nodelast[oi[pair]], L.lastk[oa[pair]]), L.nodelast[P.ri[q]]) + 1)
    pair, q = pair[h], q[h]
    t = P.ri[q]
    rws = rows.block(len(h), 0.0, np.inf)
    rows.add(rws, P.ycol[P.yfirst[pair] + k], 1.0)
    _, e, col, coef = _impl_terms(P.read[q], P.nf[t], r[k, t], dr[k, t])
    rows.add(rws[e], col, -coef)

    const, e, col, coef = _impl_terms(P.mem_b, P.nb, np.full(K, -1), L.db)
    budget_bwd = rows.block(K, -np.inf, 1.0 - P.G - const)
    rows.add(budget_bwd[e], col, coef)
    rows.add(budget_bwd[fk], P.Bbase[fk] + N, 1.0)             # stages without columns have no B_N^k
    return np.concatenate([budget_rec, budget_bwd])


def _repeat_terms(e: np.ndarray, n: int, owner: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Terms (by expression `e`, of n expressions) repeated for each row j of `owner[j]`'s expression:
    (row j, term index) pairs."""
    count = np.bincount(e, minlength=n)
    by_expr = np.argsort(e, kind="stable")
    j, off = ragged(count[owner])
    return j, by_expr[(np.cumsum(count) - count)[owner[j]] + off]


def _in_place_rows(P: _Program, rows: _Rows) -> None:
    """In-place implementations (C.3, eq. 15-16) for each forward node i and value a it may overwrite, with
    q = the sum of i's implementations overwriting a (df in the forward pass, dr^k in stage k; q <= 1 and
    q <= r, eq. 16, by the one-implementation rows): a is gone for the rest of the pass or stage, so its
    readers t > i in it (eq. 15's p replacing r in (7)) read_{t,a} + q <= 1, stage k's backward node
    D_k(a) + q^k <= 1, and it is not kept (eq. 15's s <= 2 - 2q) s_a^0 + q <= 1, s_a^{k+1} + q^k <= 1. The
    memory rows charge an in-place step its outputs less the bytes it overwrites (`_program`)."""
    L, nf = P.L, P.nf
    N, K, wi, wa = L.N, L.K, P.wi, P.wa
    if not len(wi):
        return
    key = P.ra * N + P.ri                                      # forward reads, sorted
    lo, hi = np.searchsorted(key, wa * N + wi + 1), np.searchsorted(key, wa * N + N)
    entry, off = ragged(hi - lo)                              # (entry, a read of its value by t > i)
    q = lo[entry] + off
    t = P.ri[q]

    def add(rws: np.ndarray, owner: np.ndarray, qe: np.ndarray, qcol: np.ndarray, qcoef: np.ndarray, n: int) -> None:
        j, term = _repeat_terms(qe, n, owner)
        rows.add(rws[j], qcol[term], qcoef[term])

    # the forward pass
    _, qe, qcol, qcoef = _impl_terms(P.over, nf[wi], np.full(len(wi), -1), L.df[wi])
    const, e, col, coef = _impl_terms(P.read[q], nf[t], np.full(len(q), -1), L.df[t])
    rws = rows.block(len(q), -np.inf, 1.0 - const)
    rows.add(rws[e], col, coef)
    add(rws, entry, qe, qcol, qcoef, len(wi))
    if K:
        kept = np.flatnonzero(L.s[0, wa] >= 0)
        rws = rows.block(len(kept), -np.inf, 1.0)
        rows.add(rws, L.s[0, wa[kept]], 1.0)
        add(rws, kept, qe, qcol, qcoef, len(wi))

    # each stage k where i is recomputed
    k, x = np.nonzero(L.r[:, wi] >= 0)                         # (stage, entry)
    i, a = wi[x], wa[x]
    _, qe, qcol, qcoef = _impl_terms(P.over[x], nf[i], L.r[k, i], L.dr[k, i])
    n = len(x)
    z, off = ragged(hi[x] - lo[x])                            # later readers t of a recomputed in stage k
    q = lo[x[z]] + off
    t = P.ri[q]
    keep = L.r[k[z], t] >= 0
    z, q, t = z[keep], q[keep], t[keep]
    _, e, col, coef = _impl_terms(P.read[q], nf[t], L.r[k[z], t], L.dr[k[z], t])
    rws = rows.block(len(z), -np.inf, 1.0)
    rows.add(rws[e], col, coef)
    add(rws, z, qe, qcol, qcoef, n)
    nxt = np.flatnonzero(k + 1 < K)
    kept = nxt[L.s[k[nxt] + 1, a[nxt]] >= 0]
    rws = rows.block(len(kept), -np.inf, 1.0)
    rows.add(rws, L.s[k[kept] + 1, a[kept]], 1.0)
    add(rws, kept, qe, qcol, qcoef, n)
    dkey = P.ba * K + P.bk                                     # backward reads D_k, sorted
    pos = np.minimum(np.searchsorted(dkey, a * K + k), max(len(dkey) - 1, 0))
    read = np.flatnonzero(dkey[pos] == a * K + k) if len(dkey) else np.zeros(0, np.int64)
    pos = pos[read]
    const, e, col, coef = _impl_terms(P.dep[pos], P.nb[k[read]], np.full(len(read), -1), L.db[k[read]])
    rws = rows.block(len(read), -np.inf, 1.0 - const)
    rows.add(rws[e], col, coef)
    add(rws, read, qe, qcol, qcoef, n)


def build_model(problem: Problem, budget: float, retained: float | None = None) -> tuple[MilpModel, MonetLayout]:
    """MONeT's program for `problem` under `budget` bytes (module docstring; `retained` adds the
    retention row const + sum |v| s_v^0 <= retained), each row block built as one block of COO triplets."""
    L = layout(problem, budget)
    P = _program(problem, L)
    rows = _Rows()
    offset, cost_cols, cost_coefs = _implementation_rows(P, rows)
    budget_rows = [_forward_rows(P, rows, retained)]
    _stage_rows(P, rows)
    _in_place_rows(P, rows)
    budget_rows.append(_memory_rows(P, rows))
    A, lo, hi = rows.matrix(P.ncols)
    c = np.zeros(P.ncols)
    np.add.at(c, cost_cols, cost_coefs)
    col_hi = np.ones(P.ncols)
    col_hi[L.num_vars:] = np.inf
    integrality = np.zeros(P.ncols, dtype=bool)
    integrality[:L.num_vars] = True
    model = MilpModel(c, A, lo, hi, np.zeros(P.ncols), col_hi, integrality, offset=offset, objective_scale=P.cost_unit,
                      budget_rows=np.concatenate(budget_rows).astype(np.int32))
    return model, L
