"""Topological orders several solvers start from (moccasin, dtr, olla): a low-peak greedy order, and
the check that an order keeps the random nodes in their default relative order."""

from __future__ import annotations

import numpy as np

from tasks.solve.core.problem import Problem


def memory_order(problem: Problem) -> np.ndarray:
    """A topological order that runs, among ready nodes, the one allocating the fewest net bytes (its
    outputs minus the inputs it reads last); ties by default position."""
    n, producer, users = problem.num_nodes, problem.value_producer, problem.value_users
    remaining = np.array([len(u) for u in users])
    preds = [{int(producer[w]) for w in problem.node_inputs[v] if producer[w] >= 0} for v in range(n)]
    succs: list[list[int]] = [[] for _ in range(n)]
    for v in range(n):
        for u in preds[v]:
            succs[u].append(v)
    missing = np.array([len(x) for x in preds])
    kept = np.array([bool(users[w]) or bool(problem.is_output[w]) for w in range(problem.num_values)])
    alloc = [sum(int(problem.value_bytes[w]) for w in problem.node_outputs[v] if kept[w]) for v in range(n)]
    pos = problem.position

    def net(v: int) -> tuple[int, int]:
        last = sum(int(problem.value_bytes[w]) for w in problem.node_inputs[v]
                   if producer[w] >= 0 and remaining[w] == 1 and not problem.is_output[w])
        return alloc[v] - last, int(pos[v])

    ready, order = set(np.flatnonzero(missing == 0).tolist()), []
    while ready:
        v = min(ready, key=net)
        ready.remove(v)
        order.append(v)
        for w in problem.node_inputs[v]:
            remaining[w] -= 1
        for s in succs[v]:
            missing[s] -= 1
            if missing[s] == 0:
                ready.add(s)
    return np.asarray(order, dtype=np.int64)


def keeps_random_order(problem: Problem, order: np.ndarray) -> bool:
    """Whether `order` runs the random nodes in their default relative order, as `Problem.random_nodes`
    requires of every schedule."""
    position = np.empty(len(order), dtype=np.int64)
    position[np.asarray(order)] = np.arange(len(order))
    randoms = sorted(problem.random_nodes, key=lambda v: int(problem.position[v]))
    return bool(np.all(np.diff(position[randoms]) > 0))
