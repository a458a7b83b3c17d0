"""Independent segments and the division tree (Feng & Huang 2021, sec. 5.1-5.3, Algorithms 2-4).

An independent segment (IS, Definition 1) s_ij has a source v_i, a target v_j and an interior whose
vertices connect to nothing outside s_ij. Its cost l(s_ij) is the sum of its interior's costs. A
segment is stored as (i, j, interior bitset, direct): `direct` says whether the edge e_ij belongs to
it. A segment with an interior and e_ij is a Branch IS (Algorithm 3 lines 2-5 split e_ij off first),
so the tests of Algorithms 2 and 4 only ever see segments without e_ij.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx

from tasks.solve.acg.dag import TensorDag, bits

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


def complicate_division(dag: TensorDag, seg: Segment) -> list[Segment]:
    """Algorithm 4: all IS s_kt inside s_ij (every vertex pair except (v_i, v_j) whose in-between vertices
    {v} have no connection to a vertex outside {v} ∪ {v_k, v_t}), then the maximal ones (Definition 6).

    Line 5 is evaluated with dominator trees of s_ij: every neighbour of {v} lies in {v} ∪ {v_k, v_t}
    exactly when v_k dominates and v_t post-dominates every vertex of {v}. A pair with no in-between
    vertex is an IS when the edge e_kt exists (a single-edge member)."""
    i, j = seg.source, seg.target
    everything = seg.vertices
    sub = nx.DiGraph()
    sub.add_nodes_from(bits(everything))
    sub.add_edges_from((a, b) for a in bits(everything) for b in bits(dag.succ_mask[a] & everything)
                       if (a, b) != (i, j))
    dominated = _dominated_sets(nx.immediate_dominators(sub, i), everything, reverse=False)
    postdominated = _dominated_sets(nx.immediate_dominators(sub.reverse(copy=False), j), everything, reverse=True)
    candidates = []
    for k in bits(everything):
        for t in bits(dag.descendants[k] & everything):
            if (k, t) == (i, j):
                continue
            inner = dag.descendants[k] & dag.ancestors[t] & everything
            if inner:
                if inner & ~dominated[k] or inner & ~postdominated[t]:
                    continue
            elif not _has_edge(dag, k, t):
                continue
            candidates.append((k, t, inner))
    candidates.sort(key=lambda c: (-(c[2].bit_count()), c[0], c[1]))
    maximal: list[tuple[int, int, int]] = []
    for k, t, inner in candidates:
        members = inner | (1 << k) | (1 << t)
        if not any(members & ~(m[2] | (1 << m[0]) | (1 << m[1])) == 0 for m in maximal):
            maximal.append((k, t, inner))
    maximal.sort(key=lambda c: (c[0], c[1]))
    return [make_segment(dag, k, t, inner) for k, t, inner in maximal]


def _dominated_sets(idom: dict[int, int], everything: int, reverse: bool) -> dict[int, int]:
    """Bitset of the vertices (strictly) dominated by each vertex, from immediate dominators."""
    below = {v: 0 for v in bits(everything)}
    for v in sorted(below, reverse=not reverse):
        parent = idom.get(v, v)
        if parent != v:
            below[parent] |= below[v] | (1 << v)
    return below


def _has_edge(dag: TensorDag, a: int, b: int) -> bool:
    return bool(dag.succ_mask[a] >> b & 1)


def divide(dag: TensorDag, seg: Segment) -> None:
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
    seg.children = complicate_division(dag, seg)
    ends = 0
    for child in seg.children:
        ends |= (1 << child.source) | (1 << child.target)
    seg.connecting = ends & seg.interior


def division_tree(dag: TensorDag) -> Segment:
    """Algorithm 6 line 2: the division tree (Fig. 5), root = the whole graph s_st, each non-leaf's
    children = its division, down to segments without interior (single edges)."""
    root = make_segment(dag, dag.source, dag.target, ((1 << dag.n) - 1) & ~1 & ~(1 << dag.target))
    stack = [root]
    while stack:
        seg = stack.pop()
        divide(dag, seg)
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
