"""Independent segments and the division tree (Feng & Huang 2021, sec. 5.1-5.3, Algorithms 2-4).

An independent segment (IS, Definition 1) s_ij has a source v_i, a target v_j and an interior whose
vertices connect to nothing outside s_ij. Its cost l(s_ij) is the sum of its interior's costs. A
segment is stored as (i, j, interior bitset, direct): `direct` says whether the edge e_ij belongs to
it. A segment with an interior and e_ij is a Branch IS (Algorithm 3 lines 2-5 split e_ij off first),
so the tests of Algorithms 2 and 4 only ever see segments without e_ij.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from memplan.tasks.solve.acg.dag import TensorDag, bits

EDGE, LINEAR, BRANCH, COMPLICATE = "edge", "linear", "branch", "complicate"


@dataclass(eq=False)
class Segment:
    """A node of the division tree (Fig. 5).

    `kind`: `edge` (no interior, a leaf), `linear` (Definition 3), `branch` (Definition 4) or
    `complicate` (Definition 5). `children` is the division: the member IS, in topological order for a
    linear IS. `chain` (linear IS): v_1 = i, the linear splitting vertices, v_n = j. `connecting`
    (complicate IS): bitset of the interior vertices that are endpoints of member IS."""

    source: int
    target: int
    interior: int
    direct: bool
    cost: int
    forced: bool
    kind: str = EDGE
    children: list["Segment"] = field(default_factory=list)
    chain: tuple[int, ...] = ()
    connecting: int = 0

    @property
    def vertices(self) -> int:
        return self.interior | (1 << self.source) | (1 << self.target)


def make_segment(dag: TensorDag, source: int, target: int, interior: int, direct: bool | None = None) -> Segment:
    """The IS (source, target, interior); `direct` defaults to whether the graph has the edge e_ij."""
    direct = _has_edge(dag, source, target) if direct is None else direct
    return Segment(source, target, interior, direct, dag.mask_cost(interior), bool(interior & dag.forced))


def linear_splitting_vertices(dag: TensorDag, seg: Segment) -> list[int]:
    """Algorithm 2: every v_t of the interior with {v_in} ∪ {v_out} ∪ {v_t} = V^ij, {v_in} ∩ {v_out} = ∅
    and no edge from {v_in} to {v_out} (Definition 2), in topological order. Splitting s_ij at one such
    vertex and recursing on both halves (the paper's formulation) finds exactly this set, because a
    splitting vertex of s_it or s_tj is one of s_ij and conversely."""
    i, j = seg.source, seg.target
    everything = seg.vertices
    found = []
    for t in bits(seg.interior):
        before = dag.ancestors[t] & everything
        after = dag.descendants[t] & everything
        if before | after | (1 << t) != everything or before & after:
            continue
        reach = 0
        for a in bits(before):
            reach |= dag.succ_mask[a] if a != i else dag.succ_mask[a] & ~(1 << j)
        if not reach & after:
            found.append(t)
    return found


def branches(dag: TensorDag, seg: Segment) -> list[Segment]:
    """Algorithm 3: the edge e_ij if present, then every branch: the vertices connected to a start vertex
    without passing through v_i or v_j (the BFS of lines 7-13). The start vertex is the lowest remaining
    one in topological order instead of a random one, so the division is deterministic; the branches
    found are the same for any start. One element: s_ij has no branches."""
    found = [make_segment(dag, seg.source, seg.target, 0, True)] if seg.direct else []
    found += [make_segment(dag, seg.source, seg.target, comp, False) for comp in dag.components(seg.interior)]
    return found


def complicate_division(dag: TensorDag, seg: Segment, deadline: float | None = None) -> list[Segment]:
    """Algorithm 4: every IS s_kt inside s_ij (each vertex pair except (v_i, v_j)), then the maximal ones
    (Definition 6), in order of their endpoints.

    Line 5 tests whether the in-between vertices {v} of (v_k, v_t) connect to nothing outside
    {v} ∪ {v_k, v_t}. It is applied to each branch of {v} (its weakly connected components) rather than
    to {v} as a whole: a branch that passes the test forms an IS with v_k and v_t even when another
    branch leaves, and s_kt is the union of the branches that pass, plus the edge e_kt when it exists
    (a single-edge member when no branch passes). Testing {v} whole would miss such an IS, and with it
    the optimum (e.g. s_04 = {v_0, v_1, v_4} in 0->1->4, 0->2->4, 2->3->5, 0->4, 4->5)."""
    i, j = seg.source, seg.target
    everything = seg.vertices
    inside = {v: (dag.descendants[v] & everything, dag.ancestors[v] & everything) for v in bits(everything)}
    # entered[k]: vertices after v_k all of whose predecessors are v_k or after it; left[t] likewise
    entered = {k: sum(1 << v for v in bits(after) if not dag.pred_mask[v] & ~(after | 1 << k))
               for k, (after, _) in inside.items()}
    left = {t: sum(1 << v for v in bits(before) if not dag.succ_mask[v] & ~(before | 1 << t))
            for t, (_, before) in inside.items()}
    candidates = []
    for k in bits(everything):
        _check(deadline)
        for t in bits(inside[k][0]):
            if (k, t) == (i, j):
                continue
            between = inside[k][0] & inside[t][1]
            inner = _closed_branches(dag, between, between & ~(entered[k] & left[t]))
            direct = _has_edge(dag, k, t)
            if inner or direct:
                candidates.append((k, t, inner, direct))
    candidates.sort(key=lambda c: (-(c[2].bit_count()), c[0], c[1]))
    maximal: list[tuple[int, int, int, bool]] = []
    for k, t, inner, direct in candidates:
        members = inner | (1 << k) | (1 << t)
        if not any(members & ~(m[2] | (1 << m[0]) | (1 << m[1])) == 0 for m in maximal):
            maximal.append((k, t, inner, direct))
    maximal.sort(key=lambda c: (c[0], c[1]))
    return [make_segment(dag, k, t, inner, direct) for k, t, inner, direct in maximal]


def _closed_branches(dag: TensorDag, between: int, leaking: int) -> int:
    """The union of the branches (weakly connected components) of `between` free of `leaking`
    vertices (those with a neighbour outside `between` and the pair). A component of the other
    vertices that touches no leaking vertex is a whole branch."""
    closed = 0
    for comp in dag.components(between & ~leaking):
        if not dag.neighbours(comp) & leaking:
            closed |= comp
    return closed


def _has_edge(dag: TensorDag, a: int, b: int) -> bool:
    return bool(dag.succ_mask[a] >> b & 1)


def _check(deadline: float | None) -> None:
    if deadline is not None and time.perf_counter() > deadline:
        raise TimeoutError("the time limit was reached while building the division tree")


def divide(dag: TensorDag, seg: Segment, deadline: float | None = None) -> None:
    """Classify `seg` and fill in its division (sec. 5.2): linear if it has a linear splitting vertex,
    else branch if it has two or more branches, else complicate."""
    if not seg.interior:
        return
    if seg.direct:
        seg.kind, seg.children = BRANCH, branches(dag, seg)
        return
    splitting = linear_splitting_vertices(dag, seg)
    if splitting:
        seg.kind = LINEAR
        seg.chain = (seg.source, *splitting, seg.target)
        everything = seg.vertices
        seg.children = [make_segment(dag, a, b, dag.descendants[a] & dag.ancestors[b] & everything)
                        for a, b in zip(seg.chain, seg.chain[1:])]
        return
    parts = branches(dag, seg)
    if len(parts) > 1:
        seg.kind, seg.children = BRANCH, parts
        return
    seg.kind = COMPLICATE
    seg.children = complicate_division(dag, seg, deadline)
    ends = 0
    for child in seg.children:
        ends |= (1 << child.source) | (1 << child.target)
    seg.connecting = ends & seg.interior


def division_tree(dag: TensorDag, deadline: float | None = None) -> Segment:
    """Algorithm 6 line 2: the division tree (Fig. 5), root = the whole graph s_st, each non-leaf's
    children = its division, down to segments without interior (single edges). Raises TimeoutError
    past `deadline` (a `time.perf_counter()` value)."""
    root = make_segment(dag, dag.source, dag.target, ((1 << dag.n) - 1) & ~1 & ~(1 << dag.target))
    stack = [root]
    while stack:
        seg = stack.pop()
        _check(deadline)
        divide(dag, seg, deadline)
        stack.extend(seg.children)
    return root


def walk(root: Segment):
    """All segments of the tree, parents before children."""
    stack = [root]
    while stack:
        seg = stack.pop()
        yield seg
        stack.extend(reversed(seg.children))


@dataclass(frozen=True)
class Piece:
    """One segment formed by a checkpoint set: interior vertices, entry and exit checkpoints."""

    interior: int
    entries: int
    exits: int
    cost: int

    @property
    def independent(self) -> bool:
        """Definition 1: exactly one entry and one exit checkpoint."""
        return self.entries.bit_count() == 1 and self.exits.bit_count() == 1


def pieces(dag: TensorDag, checkpoints: int) -> list[Piece]:
    """The segments a checkpoint set cuts the graph into: the weakly connected components of the
    non-checkpoint vertices, with the checkpoints feeding them and fed by them."""
    rest = ((1 << dag.n) - 1) & ~checkpoints
    found = []
    for comp in dag.components(rest):
        entries = exits = 0
        for v in bits(comp):
            entries |= dag.pred_mask[v]
            exits |= dag.succ_mask[v]
        found.append(Piece(comp, entries & checkpoints, exits & checkpoints, dag.mask_cost(comp)))
    return found
