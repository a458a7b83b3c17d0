"""The data-flow graph OLLA sees and its ASAP/ALAP analysis (Steiner et al. 2022, sec. 3.1 and 4.1).

Edges are the problem's produced values (`E`, graph inputs are constant and left out), plus zero-byte
control edges (sec. 4.3) that keep an order the runtime needs: consecutive random nodes (the
problem's `random_nodes`) in their default order, so the reordered step draws what eager PyTorch draws.

One operator runs per timestep (t = 0..n-1), so a node cannot run before all its ancestors nor after
all its descendants: ASAP(v) = |ancestors(v)|, ALAP(v) = n - 1 - |descendants(v)|. This is the paper's
span (eq. 10) for sequential schedules, and at least as tight as its longest-path distances.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from memplan.tasks.solve.core.problem import Problem


@dataclass(frozen=True, eq=False)
class Edges:
    """OLLA's edges: `src[e]` is the node creating edge e, `size[e]` its bytes, `sinks[e]` the nodes
    reading it; `is_output[e]` keeps it to the end of the step. Edges 0..len(values)-1 are the
    problem's produced values `values[e]`; the rest are control edges (size 0, no value)."""

    problem: Problem
    values: np.ndarray
    src: np.ndarray
    size: np.ndarray
    sinks: tuple[tuple[int, ...], ...]
    is_output: np.ndarray

    @property
    def num_nodes(self) -> int:
        return self.problem.num_nodes

    @cached_property
    def node_inputs(self) -> tuple[tuple[int, ...], ...]:
        """fi(v): the edges each node reads."""
        fanin: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for e, readers in enumerate(self.sinks):
            for v in readers:
                fanin[v].append(e)
        return tuple(map(tuple, fanin))

    @cached_property
    def ancestors(self) -> list[int]:
        """Bitset (Python int) of the strict ancestors of each node."""
        anc = [0] * self.num_nodes
        for v in self.problem.order.tolist():                    # a topological order
            for e in self.node_inputs[v]:
                u = int(self.src[e])
                anc[v] |= anc[u] | (1 << u)
        return anc

    @cached_property
    def descendants(self) -> list[int]:
        """Bitset of the strict descendants of each node."""
        desc = [0] * self.num_nodes
        readers = [[v for e in self.out_edges[u] for v in self.sinks[e]] for u in range(self.num_nodes)]
        for u in reversed(self.problem.order.tolist()):
            for v in readers[u]:
                desc[u] |= desc[v] | (1 << v)
        return desc

    @cached_property
    def out_edges(self) -> tuple[tuple[int, ...], ...]:
        """fo(v): the edges each node creates."""
        fanout: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for e, u in enumerate(self.src.tolist()):
            fanout[u].append(e)
        return tuple(map(tuple, fanout))

    @cached_property
    def asap(self) -> np.ndarray:
        """Earliest timestep of each node (eq. 10)."""
        return np.array([a.bit_count() for a in self.ancestors], dtype=np.int64)

    @cached_property
    def alap(self) -> np.ndarray:
        """Latest timestep of each node (eq. 10)."""
        return self.num_nodes - 1 - np.array([d.bit_count() for d in self.descendants], dtype=np.int64)

    @cached_property
    def last_use(self) -> np.ndarray:
        """Upper end of the maximum useful lifetime MUL(e) (eq. 11): max ALAP of its sinks, the last
        timestep for a graph output, and its creation's ASAP for an edge nobody reads."""
        last = self.asap[self.src].copy()
        for e, readers in enumerate(self.sinks):
            if readers:
                last[e] = max(int(self.alap[list(readers)].max()), last[e])
        last[self.is_output] = self.num_nodes - 1
        return last

    @cached_property
    def must_preserve(self) -> tuple[np.ndarray, np.ndarray]:
        """PRES(e) = [ALAP(src(e)) + 1, max ASAP of its sinks] (eq. 12; to the end for graph outputs):
        (first, last) timestep at which P[e, t] is 1 in every schedule; empty when first > last."""
        first = self.alap[self.src] + 1
        last = np.array([int(self.asap[list(r)].max()) if r else -1 for r in self.sinks], dtype=np.int64)
        last[self.is_output] = self.num_nodes - 1
        return first, last


def olla_edges(problem: Problem) -> Edges:
    """The edges of `problem` (module docstring): its produced values, then one control edge between
    each pair of consecutive random nodes in the default order."""
    base = problem.num_values - problem.num_variant_values        # variant-only values: never allocated here
    values = np.flatnonzero(problem.value_producer[:base] >= 0)
    users = problem.value_users
    random = sorted(problem.random_nodes, key=lambda v: int(problem.position[v]))
    control = list(zip(random, random[1:]))
    return Edges(
        problem=problem,
        values=values,
        src=np.concatenate([problem.value_producer[values], np.array([u for u, _ in control], dtype=np.int64)]),
        size=np.concatenate([problem.value_bytes[values], np.zeros(len(control), dtype=np.int64)]),
        sinks=tuple(users[v] for v in values.tolist()) + tuple((v,) for _, v in control),
        is_output=np.concatenate([problem.is_output[values], np.zeros(len(control), dtype=bool)]),
    )
