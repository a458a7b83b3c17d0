"""Linear computation graphs (Feng & Huang 2021, sec. 4): eq. (1) and Algorithm 1.

A chain v_0 -> ... -> v_m is described by vertex costs l(v_x) and the memory of the links between
consecutive vertices (0 for a plain LCG; the cost of a member IS when Algorithm 5 folds a Linear IS
into a chain, Fig. 6).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class ChainPath:
    """A shortest path v_0 ~> v_m of the accessibility graph: `weight` sums the checkpoint weights of
    its inner vertices and the values of the links it takes one at a time; `vertices` are chain
    indices, v_0 and v_m included; `single[x]` says whether the step into `vertices[x+1]` is one link."""

    weight: float
    vertices: tuple[int, ...]
    single: tuple[bool, ...]


def accessibility_shortest_path(memory: Sequence[int], weight: Sequence[float], link_memory: Sequence[int],
                                link_value: Sequence[float], max_term: float,
                                mergeable: Sequence[bool] | None = None,
                                pinned: Sequence[bool] | None = None) -> ChainPath:
    """Algorithm 1 lines 3-4 for one max term C: the shortest v_0 ~> v_m path of the accessibility graph
    G^A, whose edge e^A_ab (a < b) exists iff v_a and v_b can be adjacent checkpoints under C, i.e.
    l(v_a, v_b) = sum of link memories a..b-1 + sum of l(v_x), a < x < b, is at most C (sec. 4), and
    no link in between must be broken (`mergeable`) and no vertex in between must be a checkpoint
    (`pinned`). The edge e^A_{a,a+1} always exists and costs `link_value[a]` (the link's own optimum,
    0 when it stays whole). A path costs the `weight` of its inner vertices. G^A is acyclic and
    topologically ordered by chain index, so the shortest path is one pass of dynamic programming
    (the paper's O(|V|^2) edges, each relaxed once)."""
    m = len(memory) - 1
    mergeable = [True] * m if mergeable is None else mergeable
    pinned = [False] * (m + 1) if pinned is None else pinned
    span = [0] * (m + 1)      # span[b] - span[a] - memory[b] = l(v_a, v_b)
    blocked = [0] * (m + 1)   # blocked[b] - blocked[a] - pinned[b]: obstacles strictly between
    for x in range(m):
        span[x + 1] = span[x] + link_memory[x] + memory[x + 1]
        blocked[x + 1] = blocked[x] + (not mergeable[x]) + bool(pinned[x + 1])
    dist = [0.0] * (m + 1)
    back = [0] * (m + 1)
    for b in range(1, m + 1):
        best, arg = dist[b - 1] + link_value[b - 1], b - 1
        for a in range(b - 2, -1, -1):
            if span[b] - span[a] - memory[b] > max_term or blocked[b] - blocked[a] - bool(pinned[b]):
                break
            if dist[a] < best:
                best, arg = dist[a], a
        dist[b] = best + (weight[b] if b < m else 0.0)
        back[b] = arg
    path = [m]
    while path[-1]:
        path.append(back[path[-1]])
    path.reverse()
    return ChainPath(dist[m], tuple(path), tuple(b - a == 1 for a, b in zip(path, path[1:])))


@dataclass(frozen=True)
class LcgSolution:
    """Optimal gradient checkpoints of a chain: vertex indices (v_0 and v_{N-1} included), eq. (1)'s
    value and its max term."""

    checkpoints: tuple[int, ...]
    objective: int
    max_segment: int


def lcg_checkpoints(costs: Sequence[int]) -> LcgSolution:
    """Algorithm 1: minimize eq. (1), sum_i l(v^R_i) + max_i l(v^R_i, v^R_{i+1}), on the LCG with vertex
    costs `costs` (v_0 and v_{N-1} are always checkpoints). For every max term C = l(v_j, v_k) of a
    vertex pair, the accessibility graph's shortest path is a candidate; the best candidate is optimal
    because the optimum's max term is one of the C. Max terms are tried in increasing order and the loop
    stops once C alone exceeds the best objective."""
    if len(costs) < 2 or any(c < 0 for c in costs):
        raise ValueError(f"an LCG needs at least two vertices with non-negative costs, got {list(costs)[:8]}.")
    m = len(costs) - 1
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    terms = sorted({prefix[k] - prefix[j + 1] for j in range(m + 1) for k in range(j + 1, m + 1)})
    ends = costs[0] + costs[m]
    best: LcgSolution | None = None
    for term in terms:
        if best is not None and ends + term >= best.objective:
            break
        path = accessibility_shortest_path(costs, costs, [0] * m, [0.0] * m, term)
        reach = max((prefix[b] - prefix[a + 1] for a, b in zip(path.vertices, path.vertices[1:])), default=0)
        total = ends + int(path.weight) + reach
        if best is None or total < best.objective:
            best = LcgSolution(path.vertices, total, reach)
    assert best is not None
    return best

