"""MONeT's columns (tasks/solve/monet/model.py): the forward pass and the backward stages of the joint
graph, each node's implementations, and where each integer column (df, db, r, dr, s) sits."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from memplan.tasks.solve.core.problem import Problem, ProblemError


@dataclass
class Impl:
    """Implementations of one node: names (default first), inputs, outputs, workspace, cost, and the inputs
    each overwrites in place (`over`)."""

    names: tuple[str, ...]
    ins: list[frozenset[int]]
    outs: list[frozenset[int]]
    ws: np.ndarray
    cost: np.ndarray
    over: list[frozenset[int]]


@dataclass
class MonetLayout:
    """Forward nodes `fwd` (position i), backward nodes `bwd` (stage k), variable forward values `vals`
    (index a: producer position p[a], last forward reader position c[a], last stage needing it
    lastk[a]); column tables hold -1 where a variable does not exist. A step's non-default
    implementations l = 1..n-1 have the consecutive columns start + l - 1 from its start: `df[i]`
    (forward pass), `db[k]` (backward node), `dr[k, i]` (recomputation; -1 also where r[k, i] is)."""

    problem: Problem
    fwd: np.ndarray
    bwd: np.ndarray
    vals: np.ndarray
    p: np.ndarray
    c: np.ndarray
    lastk: np.ndarray
    nodelast: np.ndarray
    impl: dict[int, Impl]
    unit: float
    df: np.ndarray
    db: np.ndarray
    r: np.ndarray
    dr: np.ndarray
    s: np.ndarray
    num_vars: int

    @property
    def N(self) -> int:
        return len(self.fwd)

    @property
    def K(self) -> int:
        return len(self.bwd)


def _impls(problem: Problem, node: int) -> Impl:
    vs = [problem.variant(node, name) for name in problem.impls(node)]
    return Impl(tuple(v.name for v in vs), [frozenset(v.inputs) for v in vs], [frozenset(v.outputs) for v in vs],
                 np.array([v.workspace for v in vs], dtype=np.float64), np.array([v.cost for v in vs], dtype=np.float64),
                 [frozenset(i for _, i in v.overwrites) for v in vs])


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
    for node in bwd.tolist():
        if any(problem.variant(node, impl).overwrites for impl in problem.impls(node)):
            raise ProblemError(f"problem {problem.name!r}: backward {problem.node_label(node)} has an in-place "
                               f"implementation; MONeT's program models in-place forward nodes only (C.3).")
    return fwd, bwd


def ragged(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Groups of sizes `counts` (negative: empty) laid end to end: each element's group and its offset in it."""
    counts = np.maximum(np.asarray(counts, dtype=np.int64), 0)
    group = np.repeat(np.arange(len(counts)), counts)
    return group, np.arange(len(group)) - (np.cumsum(counts) - counts)[group]


def _starts(counts: np.ndarray, first: int) -> np.ndarray:
    """Column starts of consecutive blocks of `counts` columns from `first`; -1 for empty blocks."""
    return np.where(counts > 0, first + np.cumsum(counts) - counts, -1)


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
    extra_f = np.array([len(impl[x].names) - 1 for x in fwd.tolist()], dtype=np.int64)
    extra_b = np.array([len(impl[x].names) - 1 for x in bwd.tolist()], dtype=np.int64)
    col = 0
    df = _starts(extra_f, col)
    col += int(extra_f.sum())
    db = _starts(extra_b, col)
    col += int(extra_b.sum())
    r = np.full((K, N), -1, dtype=np.int64)
    exists = np.arange(K)[:, None] <= nodelast[None, :]
    r[exists] = col + np.arange(int(exists.sum()))
    col += int(exists.sum())
    extra_r = np.where(exists, extra_f[None, :], 0)
    dr = _starts(extra_r.ravel(), col).reshape(K, N)
    col += int(extra_r.sum())
    s = np.full((K, len(vals)), -1, dtype=np.int64)
    exists = np.arange(K)[:, None] <= lastk[None, :]
    s[exists] = col + np.arange(int(exists.sum()))
    col += int(exists.sum())
    return MonetLayout(problem, fwd, bwd, vals, p, c, lastk, nodelast, impl, float(max(budget, 1)), df, db, r, dr, s, col)
