"""The computation graph of the ACG paper (Feng & Huang 2021, sec. 4-5): vertices are tensors with a
memory cost l(v), edges are operations, one source s and one target t.

Vertices are renumbered 0..n-1 in a deterministic topological order (0 = s, n-1 = t) and vertex sets
are Python integers used as bitsets, so reachability and segment tests are a few integer operations.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Hashable, Iterable, Iterator

import networkx as nx


class AcgGraphError(ValueError):
    """A graph the ACG solver cannot take: cyclic, not single-source/single-target, bad costs."""


def bits(mask: int) -> Iterator[int]:
    """Indices of the set bits of `mask`, ascending."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


@dataclass(frozen=True, eq=False)
class TensorDag:
    """A DAG with vertices 0..n-1 in topological order; `labels[v]` is the caller's name of vertex v.

    `cost[v]` = l(v) (bytes), `preds[v]`/`succs[v]` adjacency, `forced` a bitset of vertices that must be
    gradient checkpoints (e.g. random ops, whose recomputation would change the result)."""

    labels: tuple[Hashable, ...]
    cost: tuple[int, ...]
    preds: tuple[tuple[int, ...], ...]
    succs: tuple[tuple[int, ...], ...]
    forced: int = 0

    @classmethod
    def from_networkx(cls, graph: nx.DiGraph, cost: str = "cost", forced: Iterable[Hashable] = ()) -> "TensorDag":
        """Index `graph` (vertex attribute `cost`: non-negative integer bytes). Ties in the topological
        order are broken by the graph's vertex insertion order, so the same graph gives the same
        numbering. Refuses cycles, several sources or targets, and missing or negative costs."""
        if graph.number_of_nodes() < 2:
            raise AcgGraphError(f"the computation graph has {graph.number_of_nodes()} vertices; it needs a "
                                f"source and a target.")
        if not nx.is_directed_acyclic_graph(graph):
            cycle = nx.find_cycle(graph)
            raise AcgGraphError(f"the computation graph has a cycle through {cycle[:4]}; gradient checkpoints "
                                f"are defined on acyclic graphs only.")
        sources = [v for v in graph if graph.in_degree(v) == 0]
        targets = [v for v in graph if graph.out_degree(v) == 0]
        if len(sources) != 1 or len(targets) != 1:
            raise AcgGraphError(f"the computation graph must have one source and one target, it has sources "
                                f"{sources[:5]} and targets {targets[:5]}; add a virtual source/target of cost 0.")
        rank = {v: i for i, v in enumerate(graph)}
        order = list(nx.lexicographical_topological_sort(graph, key=rank.__getitem__))
        index = {v: i for i, v in enumerate(order)}
        costs = []
        for v in order:
            c = graph.nodes[v].get(cost)
            if isinstance(c, bool) or not isinstance(c, int) or c < 0:
                raise AcgGraphError(f"vertex {v!r} has {cost}={c!r}; every vertex needs a non-negative integer "
                                    f"memory cost (bytes).")
            costs.append(c)
        forced_mask = 0
        for v in forced:
            if v not in index:
                raise AcgGraphError(f"forced checkpoint {v!r} is not a vertex of the computation graph.")
            forced_mask |= 1 << index[v]
        return cls(
            labels=tuple(order),
            cost=tuple(costs),
            preds=tuple(tuple(sorted(index[u] for u in graph.predecessors(v))) for v in order),
            succs=tuple(tuple(sorted(index[w] for w in graph.successors(v))) for v in order),
            forced=forced_mask,
        )

    @property
    def n(self) -> int:
        return len(self.cost)

    @property
    def source(self) -> int:
        return 0

    @property
    def target(self) -> int:
        return self.n - 1

    @cached_property
    def succ_mask(self) -> tuple[int, ...]:
        return tuple(sum(1 << w for w in ws) for ws in self.succs)

    @cached_property
    def pred_mask(self) -> tuple[int, ...]:
        return tuple(sum(1 << u for u in us) for us in self.preds)

    @cached_property
    def neighbour_mask(self) -> tuple[int, ...]:
        return tuple(p | s for p, s in zip(self.pred_mask, self.succ_mask))

    @cached_property
    def descendants(self) -> tuple[int, ...]:
        """desc[v]: bitset of the vertices reachable from v (v excluded)."""
        desc = [0] * self.n
        for v in reversed(range(self.n)):
            m = 0
            for w in self.succs[v]:
                m |= desc[w] | (1 << w)
            desc[v] = m
        return tuple(desc)

    @cached_property
    def ancestors(self) -> tuple[int, ...]:
        """anc[v]: bitset of the vertices that reach v (v excluded)."""
        anc = [0] * self.n
        for v in range(self.n):
            m = 0
            for u in self.preds[v]:
                m |= anc[u] | (1 << u)
            anc[v] = m
        return tuple(anc)

    def mask_cost(self, mask: int) -> int:
        """l of a vertex set: the sum of its vertices' costs."""
        return sum(self.cost[v] for v in bits(mask))

    def mask_of(self, labels: Iterable[Hashable]) -> int:
        index = {label: i for i, label in enumerate(self.labels)}
        return sum(1 << index[label] for label in set(labels))

    def labels_of(self, mask: int) -> list[Hashable]:
        return [self.labels[v] for v in bits(mask)]

    def neighbours(self, mask: int) -> int:
        """The vertices adjacent (either direction) to a vertex of `mask`."""
        found = 0
        for v in bits(mask):
            found |= self.neighbour_mask[v]
        return found

    def components(self, mask: int) -> list[int]:
        """Weakly connected components of the subgraph induced by `mask`, ordered by lowest vertex."""
        found = []
        rest = mask
        while rest:
            comp = rest & -rest
            frontier = comp
            while frontier:
                frontier = self.neighbours(frontier) & mask & ~comp
                comp |= frontier
            found.append(comp)
            rest &= ~comp
        return found

