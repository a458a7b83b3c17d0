"""Local search with the lifetime ILP on windows of the order (ours, not in the paper).

HiGHS needs minutes to presolve and solve the root of the whole-graph lifetime ILP of a training step
(a few hundred nodes), where the paper's Gurobi needed seconds. Reordering the nodes of a window of
consecutive steps changes the live bytes of those steps only: a value created before the window and
read in it lives until its last read in the window (or beyond it), one created in the window lives
from its creation to its last read there (or beyond), and everything else is the same at every step
of the window. So the window is a small problem of its own: a virtual first node creates the values
entering the window (a zero-byte control edge to every window node keeps it first), values read after
the window or graph outputs stay to its end, and the lifetime ILP solves it exactly in well under a
second. The search re-solves the window around the peak step until the peak stops improving; its
order then starts the whole-graph ILP, which proves a bound (or improves further) in the time left.
"""

from __future__ import annotations

import time

import numpy as np

from memplan.tasks.solve.core.problem import Problem
from memplan.tasks.solve.core.simulator import simulate


def window_problem(problem: Problem, order: list[int], lo: int, hi: int) -> tuple[Problem, list[int]]:
    """The subproblem of steps lo..hi-1 of `order` (module docstring): node 0 is the virtual source,
    node k > 0 is `order[lo + k - 1]`. Returns it and the real node of each of its nodes (-1 for the
    source)."""
    nodes = order[lo:hi]
    local = {v: k + 1 for k, v in enumerate(nodes)}
    after = set(order[hi:])
    producer = problem.value_producer
    users = problem.value_users
    inputs: list[list[int]] = [[] for _ in range(len(nodes) + 1)]
    outputs: list[list[int]] = [[] for _ in range(len(nodes) + 1)]
    value_of: dict[int, int] = {}
    sizes, producers, kept = [0], [0], []                    # value 0: the source's control edge
    for k in range(1, len(nodes) + 1):
        inputs[k].append(0)
    outputs[0].append(0)

    def new_value(v: int, node: int) -> int:
        value_of[v] = len(sizes)
        sizes.append(int(problem.value_bytes[v]))
        producers.append(node)
        outputs[node].append(value_of[v])
        if problem.is_output[v] or any(u in after for u in users[v]):
            kept.append(value_of[v])
        return value_of[v]

    for k, v in enumerate(nodes, start=1):
        for x in problem.node_inputs[v]:
            if producer[x] < 0:
                continue
            if x not in value_of:
                new_value(x, 0 if producer[x] not in local else local[int(producer[x])])
            inputs[k].append(value_of[x])
        for x in problem.node_outputs[v]:
            if x not in value_of:
                new_value(x, k)
    for k in range(len(nodes) + 1):                          # outputs ascending per node, as Problem wants
        outputs[k].sort()
    n = len(nodes) + 1
    sub = Problem(
        name=f"{problem.name}[{lo}:{hi}]",
        cost=np.ones(n),
        workspace=np.concatenate([[0], problem.workspace[nodes]]).astype(np.int64),
        phase=("forward",) + tuple(problem.phase[v] for v in nodes),
        node_inputs=tuple(tuple(dict.fromkeys(x)) for x in inputs),
        node_outputs=tuple(map(tuple, outputs)),
        value_bytes=np.array(sizes, dtype=np.int64),
        value_producer=np.array(producers, dtype=np.int64),
        outputs=tuple(kept),
        order=np.arange(n),
        random_nodes=tuple(local[v] for v in problem.random_nodes if v in local),
    )
    return sub, [-1] + list(nodes)


def window_search(problem: Problem, order: list[int], solve, size: int, deadline: float | None) -> list[int]:
    """Re-solve windows of `size` steps around the peak steps with `solve(subproblem, time_limit) ->
    order of the subproblem or None` while the peak (or the number of steps at it) decreases and time
    remains (module docstring)."""
    order = list(order)
    score = _score(problem, order)
    tried: set[tuple[int, int]] = set()
    while deadline is None or time.perf_counter() < deadline:
        timeline = simulate(problem, [("compute", v) for v in order]).timeline
        starts = dict.fromkeys(max(0, min(int(p) - size // 2, len(order) - size))
                               for p in np.flatnonzero(timeline == score[0]))
        windows = [(lo, min(len(order), lo + size)) for lo in starts if (lo, min(len(order), lo + size)) not in tried]
        if not windows:
            return order
        lo, hi = windows[0]
        tried.add((lo, hi))
        sub, real = window_problem(problem, order, lo, hi)
        remaining = None if deadline is None else max(deadline - time.perf_counter(), 0.0)
        local = solve(sub, remaining)
        if local is None or local[0] != 0:
            continue
        candidate = order[:lo] + [real[k] for k in local[1:]] + order[hi:]
        found = _score(problem, candidate)
        if found < score:
            order, score, tried = candidate, found, set()
    return order


def _score(problem: Problem, order: list[int]) -> tuple[int, int]:
    """(peak, number of steps at the peak): a window that lowers one of several peak steps is progress."""
    timeline = simulate(problem, [("compute", v) for v in order]).timeline
    peak = int(timeline.max(initial=0))
    return peak, int((timeline == peak).sum())
