"""Optimal gradient checkpoints on the division tree (Feng & Huang 2021, Algorithms 5 and 6).

Algorithm 5 is evaluated as a minimization over the division tree: for a max term C and checkpoint
weights w (w = l for eq. (2)), `value(s)` is the least total weight of checkpoints inside an IS s whose
endpoints are checkpoints, such that every segment is at most C:
- s stays whole if l(s) <= C (line 1);
- a Linear IS is the chain of its member IS (line 4): a shortest path of the accessibility graph
  (the LCG solver, lines 8-9) in which a member too big for C is broken down recursively (line 10);
- a broken Branch IS costs the sum over its branches, a broken Complicate IS the weight of its
  connecting vertices plus the sum over its members (lines 12-15).
With w = l >= 0 this is the paper's recursion; breaking an IS that may stay whole never helps, so it is
not tried. With arbitrary weights (the budgeted mode) staying whole and breaking are both evaluated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from memplan.tasks.solve.acg.dag import TensorDag, bits
from memplan.tasks.solve.acg.division import COMPLICATE, EDGE, LINEAR, Segment, division_tree, pieces, walk
from memplan.tasks.solve.acg.lcg import ChainPath, accessibility_shortest_path


@dataclass(frozen=True)
class AcgSolution:
    """A checkpoint set (bitset over the dag's vertices, source and target included).

    `memory` = eq. (2): sum of the checkpoints' costs + the largest segment; `objective` = the same with
    checkpoint weights w in place of costs (equal to `memory` in the memory-optimal mode);
    `max_term` = the C whose recursion produced it."""

    checkpoints: int
    objective: float
    memory: int
    max_segment: int
    max_term: int


class DivisionSearch:
    """Algorithm 5 over one division tree, for any max term C and fixed checkpoint weights."""

    def __init__(self, dag: TensorDag, root: Segment, weight: Sequence[float] | None = None):
        self.dag, self.root = dag, root
        self.weight = list(dag.cost if weight is None else weight)
        if len(self.weight) != dag.n:
            raise ValueError(f"{len(self.weight)} checkpoint weights for {dag.n} vertices.")
        self.nonnegative = min(self.weight) >= 0
        self._chains = {id(s): _ChainShape(dag, s) for s in walk(root) if s.kind == LINEAR}
        self._memo: dict[int, tuple[float, object]] = {}
        self._term = math.nan

    def max_terms(self) -> list[int]:
        """Algorithm 6 line 1: the cost of every IS a checkpoint set can leave as a segment: each
        division-tree node and each run of consecutive members of a Linear IS (with the linear
        splitting vertices in between), and 0."""
        terms = {0}
        for seg in walk(self.root):
            terms.add(seg.cost)
            chain = self._chains.get(id(seg))
            if chain is not None:
                for b in range(1, len(chain.memory)):
                    terms.update(chain.span[b] - chain.span[a] - chain.memory[b] for a in range(b))
        return sorted(terms)

    def value(self, max_term: float) -> float:
        """Least weight of the checkpoints strictly inside the graph with every segment <= max_term."""
        if max_term != self._term:
            self._memo, self._term = {}, max_term
        return self._value(self.root)

    def checkpoints(self, max_term: float) -> int:
        """The checkpoint set achieving `value(max_term)`, source and target included."""
        self.value(max_term)
        return self._collect(self.root) | (1 << self.dag.source) | (1 << self.dag.target)

    def _whole(self, seg: Segment) -> bool:
        return not seg.forced and seg.cost <= self._term

    def _value(self, seg: Segment) -> float:
        if seg.kind == EDGE:
            return 0.0
        key = id(seg)
        if key in self._memo:
            return self._memo[key][0]
        whole = self._whole(seg)
        if whole and self.nonnegative:
            result: tuple[float, object] = (0.0, None)
        elif seg.kind == LINEAR:
            path = self._chains[key].path(self, seg)
            result = (path.weight, path)
        else:
            broken = sum(self._value(child) for child in seg.children)
            if seg.kind == COMPLICATE:
                broken += sum(self.weight[v] for v in bits(seg.connecting))
            result = (0.0, None) if whole and broken >= 0 else (broken, seg.kind)
        self._memo[key] = result
        return result[0]

    def _collect(self, seg: Segment) -> int:
        if seg.kind == EDGE:
            return 0
        choice = self._memo[id(seg)][1]
        if choice is None:
            return 0
        if isinstance(choice, ChainPath):
            chain = [seg.chain[x] for x in choice.vertices]
            found = sum(1 << v for v in chain[1:-1])
            for x, single in zip(choice.vertices, choice.single):
                if single:
                    found |= self._collect(seg.children[x])
            return found
        found = seg.connecting if choice == COMPLICATE else 0
        for child in seg.children:
            found |= self._collect(child)
        return found


class _ChainShape:
    """The chain a Linear IS folds into (Fig. 6): its vertices' costs and its members' costs."""

    def __init__(self, dag: TensorDag, seg: Segment):
        self.memory = [dag.cost[v] for v in seg.chain]
        self.link_memory = [child.cost for child in seg.children]
        self.mergeable = [not child.forced for child in seg.children]
        self.pinned = [bool(dag.forced >> v & 1) for v in seg.chain]
        self.span = [0] * len(self.memory)
        for x, link in enumerate(self.link_memory):
            self.span[x + 1] = self.span[x] + link + self.memory[x + 1]

    def path(self, search: DivisionSearch, seg: Segment) -> ChainPath:
        return accessibility_shortest_path(
            self.memory, [search.weight[v] for v in seg.chain], self.link_memory,
            [search._value(child) for child in seg.children], search._term, self.mergeable, self.pinned)


def max_segment(dag: TensorDag, checkpoints: int) -> int:
    """The second term of eq. (2): the largest segment left by a checkpoint set."""
    return max((p.cost for p in pieces(dag, checkpoints)), default=0)


def acg_checkpoints(dag: TensorDag, weight: Sequence[float] | None = None,
                    search: DivisionSearch | None = None) -> AcgSolution:
    """Algorithm 6: build the division tree, run Algorithm 5 for every max term C and keep the best
    sum_i w(v^R_i) + C, which minimizes eq. (2) (w = l, the default) or its weighted form: the optimum's
    largest segment is one of the C, and for that C the recursion finds checkpoints at most as heavy.
    Terms are tried in increasing order; the loop stops once C plus the recursion's floor (its value
    with no limit on segments) cannot beat the best."""
    search = search or DivisionSearch(dag, division_tree(dag), weight)
    ends = search.weight[dag.source] + search.weight[dag.target]
    terms = search.max_terms()
    floor = ends + search.value(terms[-1])
    best_term, best = terms[-1], math.inf
    for term in terms:
        if term + floor >= best:
            break
        total = ends + search.value(term) + term
        if total < best:
            best_term, best = term, total
    chosen = search.checkpoints(best_term)
    reach = max_segment(dag, chosen)
    return AcgSolution(
        checkpoints=chosen,
        objective=sum(search.weight[v] for v in bits(chosen)) + reach,
        memory=dag.mask_cost(chosen) + reach,
        max_segment=reach,
        max_term=best_term,
    )
